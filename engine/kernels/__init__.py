"""The kernel wing: every kernel the forward runs, behind one table (`table.Kernels`) and its selector
(`table.select_kernels`), which the model calls once per engine. Nothing here imports the model, the prompt, the
prefix bank, the graph manager or the scoring above it; the bucket sizes it checks GEMMs at come from
`engine.buckets`, below both (`tests/test_architecture.py` holds the rule).

The tables, one module each, named for the path they serve:
- `table`: `Kernels`, `select_kernels` and the four tables' builders;
- `pytorch`: transformers' own formulas (the CPU path, and CUDA without fla), the reference the others are tested
  against;
- `cpu_deterministic`: the PyTorch table made batch-invariant (deterministic scoring on the CPU);
- `cuda_fast`: fla's Gated DeltaNet recurrence and the fused Triton kernels below (CUDA);
- `cuda_deterministic`: the batch-invariant Triton matmul and attention, and `InvariantLinear`, that the deterministic
  CUDA table swaps into the fast one.

The families the tables are built from, one module each:
- `attention`: what every table's attention shares (`AttentionOut`, the fused attention with its log-sum-exp);
- `suffix_attention`: a suffix pass's whole attention in one Triton kernel, and the answers' attention;
- `fused`: the fused Triton kernels of the CUDA forward (norms, q/k norm + RoPE, the attention's gate, SwiGLU, a row's
  log-sum-exp);
- `causal_conv`: the Gated DeltaNet's causal conv fused with the q/k L2 norms;
- `indexed_delta_rule`, `delta_rule_inputs`, `decay`: the suffix pass's delta rule from prefix states read by index,
  and its inputs (the WY matrix, the decay and beta) in fewer launches than fla's;
- `vocab_logsumexp`: the full vocabulary's log-sum-exp in one GEMM kernel (the label mass);
- `blocked_linear`: the batch-invariant GEMM in cuBLAS's own kernels, in blocks of a fixed row count;
- `pdl`: programmatic dependent launch, which every Triton kernel here takes.
"""
