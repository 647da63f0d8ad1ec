# Source on the GPU machine: installs the carried wheels (.whl/) into /tmp/site and puts them on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(0))"
