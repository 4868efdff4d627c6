"""The benchmark behind `tinygpt bench`: this machine's limits, then training and generation speed,
each beside Hugging Face transformers on the same sizes (and, for generation, the same weights):
GPT2LMHeadModel for GPT-2's layout, LlamaForCausalLM for the SmolLM2-135M-shaped rows (the Llama
family), measured in the same run.

A shared machine's figures move 10-30% from one minute to the next, so what to read are the
ratios between rows measured in the same run; the limits measured at the start (matmul FLOP/s,
memory read bandwidth) turn speeds into MFU and bandwidth use.

    limits       dense matmul GFLOP/s (float32, bfloat16), memory read GB/s (a sum over 1 GiB; on a
                 GPU a device-to-device copy, bytes read and written); on a GPU also its datasheet's
                 dense bf16 peak and memory bandwidth, where tinygpt.calc.hardware knows the GPU
    training     tokens/s and MFU of real `tinygpt.train` steps (AdamW, clipping, logging) and of a
                 transformers loop with fused AdamW, float32 and bfloat16 autocast (on a GPU: GPT-2
                 at 16 x 1024 in bfloat16, eager and with --compile)
    step         a training step of the default block (Muon + AdamW) and of GPT-2's (AdamW) at the same size
                 (4 x 128 and 6 x 384, batch 32 x 128), the profiler's share of it in matrix products, and the
                 same products timed alone as plain GEMMs: how far each block's step is from the machine's limit
    generation   prefill tokens/s, time to first token, decode tokens/s at batch 1 and 8 (the new tokens
                 over the whole call's wall clock, a 16-token prompt included, as a user decodes), with and
                 without the KV cache, for each weight format (on a GPU also through torch.compile,
                 CUDA graphs); decode bandwidth use (bytes of weights and cache read per token / time /
                 bandwidth); and, at batch 1 on a CPU, llama.cpp decoding tinygpt's own GGUF export of
                 the same weights in f32, f16, Q8_0 and Q4_0 (its own quantizer makes the last two),
                 on the quiet machine and again "busy", beside one process that spins on a core (a
                 laptop doing something else)
    dpo          on a CPU, the milliseconds of a `tinygpt dpo` step (the reference's forward, the policy's
                 forward and backward, AdamW) beside a step of TRL's DPOTrainer on the same Qwen2-shaped
                 model, pairs and batch, float32
    grpo         on a CPU, the milliseconds of a `tinygpt grpo` step (a group of completions a prompt sampled
                 on tinygpt's decoding, the rewards, the policy's forward and backward, AdamW) beside a step
                 of TRL's GRPOTrainer on the same model, prompts, reward, group size and completion length

MFU and bandwidth use are against the measured limits on a CPU, and against the datasheet's dense
bf16 peak and memory bandwidth on a GPU (MFU as PaLM defines it; a GPU it does not know: the measured
ones). Every report starts with the CPU and the instruction sets that decide which kernels are fast
(AVX2, AVX-512, AVX-512 BF16, VNNI, AMX), since the same code ranks differently on each.

transformers and llama.cpp (llama-cpp-python) are imported only in `peers`, and TRL only in `dpo`, `grpo` and
`policy`, and only when installed (the hf, llama and dev extras); without them the tinygpt rows are measured
alone.

A module a part: `plans` (what a run measures), `machine` (the CPU, its flags and limits), `clock`
(timing), `peers` (transformers and llama.cpp), `training`, `step`, `generation`, `dpo` and `grpo` (the rows),
`policy` (the model the DPO and GRPO rows train, and how each side's step is timed), `report` (the ratios and
tables) and `measure` (`run`, the whole of it).
"""

from .measure import run
from .plans import FULL, GPU, GPU_QUICK, QUICK, SMOKE, Plan, plan_for
from .report import ratios, render

__all__ = ["run", "render", "ratios", "Plan", "plan_for", "FULL", "QUICK", "GPU", "GPU_QUICK", "SMOKE"]
