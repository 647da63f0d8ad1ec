#!/usr/bin/env bash
# Packs what the GPU machine (no Java, no network) needs to run the pinned Apache Kafka into .gpu-kafka/ (gitignored),
# for the device tool's `carry`: a jlink-ed Java runtime (the modules Kafka's broker and StorageTool load: java.desktop
# for java.beans, which its config validation uses) and the broker's jars repacked uncompressed, so that xz packs
# their classes (41 MB as they come, ~16 MB so). bench/gpu_setup.sh unpacks them there. Needs a JDK with jlink
# (the Temurin 25 beside the default Java here) and the jars (bash dev/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
JDK=${JDK:-/usr/lib/jvm/temurin-25-jdk-amd64}
LIBS=$(.venv/bin/python -c "from worker.devbroker.apache_kafka import resolve_kafka; print(resolve_kafka())")
OUT=.gpu-kafka
rm -rf "$OUT" && mkdir -p "$OUT/stage/libs"
"$JDK/bin/jlink" --add-modules java.base,java.logging,java.management,java.naming,java.xml,jdk.unsupported,java.security.jgss,java.security.sasl,jdk.management,java.desktop \
    --strip-debug --no-man-pages --no-header-files --compress=zip-0 --output "$OUT/stage/jre"
.venv/bin/python - "$LIBS" "$OUT/stage/libs" <<'PY'
"""Each jar again, stored rather than deflated (xz packs the classes far better), without the native libraries of
other platforms than Linux on x86-64 (zstd-jni, snappy-java, lz4-java: ~23 MB of them as they come)."""
import re, sys, zipfile
from pathlib import Path

# zstd-jni: linux/amd64/; snappy-java: .../native/Linux/x86_64/; lz4-java: .../linux/amd64/
LINUX_X86_64 = re.compile(r"(^|/)linux/(amd64|x86_64)/", re.IGNORECASE)

source, target = Path(sys.argv[1]), Path(sys.argv[2])
for jar in sorted(source.glob("*.jar")):
    with zipfile.ZipFile(jar) as zin, zipfile.ZipFile(target / jar.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            native = info.filename.endswith((".so", ".dll", ".dylib", ".jnilib", ".a"))
            if native and not LINUX_X86_64.search(info.filename):
                continue
            zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_STORED)
PY
tar -C "$OUT/stage" -cf - jre | xz -9 -T2 > "$OUT/jre.tar.xz"
tar -C "$OUT/stage" -cf - libs | xz -9 -T2 > "$OUT/kafka-libs.tar.xz"
rm -rf "$OUT/stage"
ls -la "$OUT"
