"""The in-process GPU decoding loops (batch 1, greedy): plain, speculative sequential and overlapped,
with runner-up branches. Benchmarks only (bench.gpu, bench.gpu_branches): the served path is app/."""
