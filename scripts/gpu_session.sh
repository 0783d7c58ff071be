#!/bin/bash
# The GPU checks and measurements of issue 10, in stages, for a session with a CUDA machine:
#
#   scripts/gpu_session.sh [--wheels DIR] [--out DIR] STAGE...
#
# Stages (each bounded by a timeout, its log in --out):
#   tests    the GPU tests: fused kernels against the PyTorch references, CUDA-graph and overlap
#            decode against eager, extend graphs against eager fused extends, the cache differential under pressure,
#            a warmed-up engine's bits against an unwarmed one's, mixed chunked prefill against plain steps, images
#            (their cache workload on CUDA against the CPU, text after an image through fused extends) (~60-140 s);
#            then the kernels' offsets past 2^31 elements (tests/test_kernel_offsets.py, one worker: 16-32 GiB a case)
#   decode   benchmarks/gpu_decode.py --batches 1,8,64 --repeats 5 --log-compiles: decode, prefill and
#            the cached TTFT against transformers + fla and the HBM roofline (~4 min)
#   ttft     the cached TTFT alone, fused extend on and bypassed (gpu_decode.py --batches 1 --hyla-only
#            --extend-ab --no-write), with and without the Gated DeltaNet chunks' WY pre-pass (--variants, one
#            engine), and where its time goes (gpu_profile.py --batches "") (~2.5 min)
#   pdl      batch-1 decode with the GEMV step's kernels launched with and without programmatic dependent
#            launch, and with cuBLAS in projections: four variants in one engine, interleaved
#            (gpu_decode.py --variants "pdl=1,gemv-in=1; ...") (~2 min)
#   moe      gpu_decode.py --moe: batch 1 and 8 of the model with MoE layers (their experts gathered or grouped
#            in the CUDA graphs) against transformers, then without CUDA graphs; batch 32 at gather caps 64
#            (grouped) and 256 (gathered) (~6 min)
#   jamba    gpu_decode.py --jamba --batches 1,8,64: the Jamba-style model (Mamba1 layers on selective_scan.py's
#            Triton kernels, in CUDA graphs; 16 experts, top-2) against transformers, and the HBM roofline (~4 min)
#   kimi     gpu_decode.py --kimi --batches 1,8,64: the Kimi-Linear-style model (KDA on kda_decode.py's and MLA on
#            latent_attention.py's Triton kernels, in CUDA graphs; 32 experts, top-8, a shared expert) against
#            transformers + fla, and the HBM roofline; then its decode with KDA's conv in the KDA kernel and in
#            a kernel of its own (--variants kda-fuse-conv=1/0) (~6 min)
#   olmo     gpu_decode.py --olmo --batches 1,8,64: the OLMo-Hybrid-style model (Gated DeltaNet kernels with beta =
#            2 sigmoid(b), post-norm NoPE attention, in CUDA graphs) against transformers + fla, and the HBM roofline
#            (~4 min)
#   zamba2   gpu_decode.py --zamba2 --batches 1,8,64: the Zamba2-style model (Mamba2 kernels, hybrid layers running
#            shared attention + GeGLU blocks on [x | embeddings], in CUDA graphs) against transformers (+ mamba_ssm
#            where installed), and the HBM roofline (~4 min)
#   minimax  gpu_decode.py --minimax --batches 1,8,64: the MiniMax-style model (lightning attention on the Mamba2
#            kernels with dt held at 1, softmax attention 7:1, 8 experts top-2 in every layer, in CUDA graphs) against
#            transformers' PyTorch lightning attention, and the HBM roofline (~4 min)
#   fp8      FP8 weights kept in float8: their kernels and engines against the dequantized model
#            (tests/test_fp8_kernels.py, test_model_quantization.py's gpu tests), then decode and TTFT of the benchmark
#            model quantized at load (gpu_decode.py --quantization fp8 --hyla-only; the bf16 numbers: the decode
#            stage) and of the model with MoE layers; a float8 KV cache: its kernels and engines
#            (tests/test_kv_cache_fp8.py), and decode after 4,096 tokens against bf16 KV (kv_cache_dtype.py) (~6 min)
#   spec     benchmarks/speculative.py --part gpu and --part mtp-gpu: n-gram and MTP speculation on vs off, every
#            step from CUDA graphs (the MTP head's drafts too), and MTP trees (top-2, 6 nodes) beside the chains (~5 min)
#   startup  benchmarks/startup.py --gpu-model --repeats 2: the first cold and cached TTFT of a fresh process against
#            its steady ones, with the engine's start-up warm-up and without (~3 min)
#   lora     benchmarks/lora.py --gpu-model --dtype bfloat16: decode and TTFT of an engine serving 4 random rank-16
#            adapters (its LoRA CUDA graphs: punica's shrink and expand) against the base model's, with no adapter,
#            one, and every adapter in a batch; then the adapters taking turns in one slot (max_cpu_loras: a slot
#            written between steps) (~5 min: three engines start)
#   mixed    benchmarks/mixed_chunk.py --gpu-model: 8 streams while an 8,192-token prompt is prefilled, with mixed
#            chunked prefill (enable_mixed_chunk) and without (~2 min)
#   hicache  benchmarks/host_cache.py --gpu-model: interleaved agentic sessions on a 4,096-token device pool, the
#            host tier (x8) against the device alone: hits, TTFT, and what the host copies cost; and the tier's
#            deferred saves against saves that wait for their copies (--waiting-saves) (~4 min)
#   profile  benchmarks/gpu_profile.py: where a batch-1 decode step and the prefills spend their time
#   outproj  benchmarks/out_projection.py --sweep --rows 2,1: the fused out projection's tile constants, and
#            the in projections' GEMV against cuBLAS, without and with PDL
#   state    benchmarks/state_ops.py --device cuda: the state pool's slot operations
#   attn     benchmarks/attention_tiles.py: the extend attention's tiles against PyTorch's SDPA (~2 min)
#   kernels  benchmarks/recurrent_tiles.py and fla_prefill.py: the recurrent kernels' tiles (Gated DeltaNet,
#            Mamba2, Mamba1, KDA), and hyla's chunked kernels against fla's per length (~8 min)
#
# --wheels DIR: pip-install the wheels there first (into /tmp/site, no index, no dependencies), for a
# machine that cannot reach PyPI: fla-core (the Triton GDN kernels; the GPU extra) and llguidance.
# Fetch them on a machine that can, for the GPU machine's Python (3.12 here):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d DIR fla-core==0.6.0 llguidance
# The machine's own torch is used: never reinstall it. Benchmarks that write docs/benchmarks.md write
# it in this checkout; --out gets a copy.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-session}
if [ "${1:-}" = "--wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$2"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    shift 2
fi
if [ "${1:-}" = "--out" ]; then out=$2; shift 2; fi
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stage() { echo; echo "=== $(date +%T) $*"; }
stage env
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import fla; print('fla', fla.__version__)" || echo "fla missing: transformers' side and fla_prefill.py run without it"
workers=$(( $(nproc) < 16 ? $(nproc) : 16 ))
for s in "$@"; do
    stage "$s"
    case $s in
        tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -n "$workers" -rfE tests/test_fused_decode.py \
                   tests/test_fused_extend.py tests/test_fused_selective_scan.py tests/test_fused_kimi_linear.py \
                   tests/test_engine_overlap.py \
                   tests/test_engine_mixed_chunk.py \
                   tests/test_engine_weight_update.py::test_cuda_graphs_replay_the_new_weights \
                   tests/test_engine_lora.py::test_adapters_on_a_gpu_equal_their_merged_models \
                   tests/test_engine_lora.py::test_shrink_and_expand_kernels_equal_the_masked_gemms \
                   tests/test_engine_images.py::test_images_on_a_gpu_equal_the_cpu \
                   tests/test_engine_images.py::test_fused_extends_after_an_image_run_at_its_positions 2>&1 \
                   | tee "$out/tests.log" | tail -30
               # one worker: each case holds 16-32 GiB of device memory (rows 2^31 elements apart)
               timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_kernel_offsets.py 2>&1 \
                   | tee "$out/offsets.log" | tail -8 ;;
        decode) timeout 330 python3 benchmarks/gpu_decode.py --batches 1,8,64 --repeats 5 --hf-max-batch 8 \
                    --log-compiles --extend-ab --json "$out/gpu_decode.json" 2>&1 | tee "$out/decode.log" | tail -60 ;;
        ttft) timeout 180 python3 benchmarks/gpu_decode.py --batches 1 --repeats 7 --hyla-only --extend-ab --no-write \
                  --variants "gdn-wy=1; gdn-wy=0" 2>&1 | tee "$out/ttft.log" | tail -16
              timeout 120 python3 benchmarks/gpu_profile.py --out "$out/profile-ttft" --batches "" --no-traces 2>&1 \
                  | tee "$out/profile-ttft.log" | tail -12 ;;
        pdl) timeout 200 python3 benchmarks/gpu_decode.py --batches 1 --repeats 7 --hyla-only --no-write \
                 --variants "pdl=1,gemv-in=1; pdl=0,gemv-in=1; pdl=0,gemv-in=0; pdl=1,gemv-in=0" 2>&1 \
                 | tee "$out/pdl.log" | tail -10 ;;
        moe) timeout 240 python3 benchmarks/gpu_decode.py --moe --batches 1,8 --repeats 3 --hf-max-batch 8 \
                 --json "$out/gpu_decode_moe.json" 2>&1 | tee "$out/moe.log" | tail -14
             timeout 120 python3 benchmarks/gpu_decode.py --moe --batches 1,8 --repeats 3 --hyla-only --no-cuda-graph \
                 --no-write 2>&1 | tee -a "$out/moe.log" | grep -E "decode, batch|Error|error"
             for cap in 64 256; do  # batch 32 (256 pairs): grouped at the default cap, gathered at 256
                 timeout 120 python3 benchmarks/gpu_decode.py --moe --batches 32 --repeats 3 --hyla-only --no-write \
                     --moe-gather-max $cap 2>&1 | tee -a "$out/moe.log" | grep -E "decode, batch|Error|error"
             done ;;
        jamba) timeout 300 python3 benchmarks/gpu_decode.py --jamba --batches 1,8,64 --repeats 3 --hf-max-batch 8 \
                   --json "$out/gpu_decode_jamba.json" 2>&1 | tee "$out/jamba.log" | tail -20 ;;
        kimi) timeout 300 python3 benchmarks/gpu_decode.py --kimi --batches 1,8,64 --repeats 3 --hf-max-batch 8 \
                  --json "$out/gpu_decode_kimi.json" 2>&1 | tee "$out/kimi.log" | tail -20
              timeout 150 python3 benchmarks/gpu_decode.py --kimi --batches 1,8 --repeats 5 --hyla-only --no-write \
                  --variants "kda-fuse-conv=1; kda-fuse-conv=0" 2>&1 | tee "$out/kimi-conv.log" | tail -8 ;;
        olmo) timeout 300 python3 benchmarks/gpu_decode.py --olmo --batches 1,8,64 --repeats 3 --hf-max-batch 8 \
                  --json "$out/gpu_decode_olmo.json" 2>&1 | tee "$out/olmo.log" | tail -20 ;;
        zamba2) timeout 300 python3 benchmarks/gpu_decode.py --zamba2 --batches 1,8,64 --repeats 3 --hf-max-batch 8 \
                  --json "$out/gpu_decode_zamba2.json" 2>&1 | tee "$out/zamba2.log" | tail -20 ;;
        minimax) timeout 300 python3 benchmarks/gpu_decode.py --minimax --batches 1,8,64 --repeats 3 --hf-max-batch 8 \
                     --json "$out/gpu_decode_minimax.json" 2>&1 | tee "$out/minimax.log" | tail -20 ;;
        fp8) timeout 200 python3 -m pytest -q -p no:cacheprovider -n "$workers" -rfE tests/test_fp8_kernels.py \
                 tests/test_kv_cache_fp8.py \
                 "tests/test_model_quantization.py::test_gpu_engine_with_kept_fp8_weights" 2>&1 | tee "$out/fp8.log" | tail -8
             timeout 240 python3 benchmarks/gpu_decode.py --quantization fp8 --batches 1,8,64 --repeats 5 --hyla-only \
                 --no-write --json "$out/gpu_decode_fp8.json" 2>&1 | tee -a "$out/fp8.log" | tail -14
             timeout 200 python3 benchmarks/gpu_decode.py --moe --quantization fp8 --batches 1,8 --repeats 3 --hyla-only \
                 --no-write 2>&1 | tee -a "$out/fp8.log" | grep -E "decode, batch|prefill|TTFT|Error|error"
             timeout 200 python3 benchmarks/kv_cache_dtype.py --device cuda --gpu-model --repeats 3 --context 4096 \
                 --batch 32 --no-write 2>&1 | tee -a "$out/fp8.log" | tail -12 ;;
        spec) timeout 200 python3 benchmarks/speculative.py --part gpu --repeats 3 --new-tokens 128 2>&1 \
                  | tee "$out/spec.log" | tail -12
              timeout 200 python3 benchmarks/speculative.py --part mtp-gpu --repeats 3 --new-tokens 128 2>&1 \
                  | tee "$out/spec-mtp.log" | tail -12 ;;
        startup) timeout 240 python3 benchmarks/startup.py --device cuda --gpu-model --repeats 2 2>&1 \
                     | tee "$out/startup.log" | tail -14 ;;
        lora) timeout 420 python3 benchmarks/lora.py --device cuda --gpu-model --dtype bfloat16 --repeats 3 2>&1 \
                  | tee "$out/lora.log" | tail -12 ;;
        mixed) timeout 200 python3 benchmarks/mixed_chunk.py --device cuda --gpu-model --repeats 3 2>&1 \
                     | tee "$out/mixed.log" | tail -10 ;;
        hicache) timeout 420 python3 benchmarks/host_cache.py --device cuda --gpu-model --repeats 3 --ratios 8 --waiting-saves 2>&1 \
                     | tee "$out/hicache.log" | tail -10 ;;
        profile) timeout 200 python3 benchmarks/gpu_profile.py --out "$out/profile" --batches 1 --no-traces 2>&1 \
                     | tee "$out/profile.log" | tail -60 ;;
        outproj) timeout 150 python3 benchmarks/out_projection.py --sweep --rows 2,1 --repeats 10 2>&1 \
                     | tee "$out/outproj.log" | tail -40 ;;
        attn) timeout 150 python3 benchmarks/attention_tiles.py --repeats 10 2>&1 | tee "$out/attn.log" | tail -12 ;;
        state) timeout 60 python3 benchmarks/state_ops.py --device cuda 2>&1 | tee "$out/state.log" ;;
        kernels) timeout 400 python3 benchmarks/recurrent_tiles.py --repeats 7 2>&1 | tee "$out/tiles.log" | tail -48
                 timeout 90 python3 benchmarks/fla_prefill.py --repeats 9 --lengths 296,1024,2048,4096 2>&1 \
                     | tee "$out/fla_prefill.log" | tail -20 ;;
        *) echo "unknown stage $s (tests decode ttft pdl moe jamba kimi olmo zamba2 minimax fp8 spec startup lora mixed profile outproj attn state kernels)"; exit 2 ;;
    esac
done
cp docs/benchmarks.md "$out/benchmarks.md"
stage done
