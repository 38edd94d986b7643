# Sourced by the studies' GPU scripts, from the repository root: wheels under .whl/ (pydantic, pydantic-core,
# annotated-types, typing-inspection, mergekit, immutables, gguf, transformers) go into /tmp/site once per machine,
# and PYTHONPATH puts them and the repository first.
if [ ! -d /tmp/site ] && compgen -G ".whl/*.whl" >/dev/null; then  # an earlier call on this machine may have done it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
