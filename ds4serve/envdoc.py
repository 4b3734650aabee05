"""Write ``docs/ENVIRONMENT.md`` from the registry in :mod:`ds4serve.envs`, or check that it is current.

``python -m ds4serve.envdoc`` rewrites the file; ``python -m ds4serve.envdoc --check`` exits 1 when
it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import envs

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "docs" / "ENVIRONMENT.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds4serve.envdoc", description=__doc__)
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the registry")
    args = parser.parse_args(argv)
    text = envs.markdown()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.is_file() else ""
        if current != text:
            print(f"{args.path} is stale: run python -m ds4serve.envdoc", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
