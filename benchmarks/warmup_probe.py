"""Where a fresh process's start-up goes on a GPU: imports, CUDA's initialisation, and
the pieces of deqbench.run.task.warm_up, each timed in this process, in order.

    python benchmarks/warmup_probe.py            # run it twice: the second run finds the
    python benchmarks/warmup_probe.py            # page cache and Triton's disk cache warm
"""

from __future__ import annotations

import time

T0 = time.perf_counter()
marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, time.perf_counter()))


import distributed  # noqa: E402,F401

mark("import distributed")
import torch  # noqa: E402

mark("import torch")
from deqbench.core.registry import analyses, inits, models, solvers  # noqa: E402
from deqbench.data import base, images, kglm, small  # noqa: E402,F401
from deqbench.run import results, task, train  # noqa: E402,F401

for r in (models, solvers, inits, analyses):
    r.names()
mark("deqbench modules + registries")
torch.optim.Adam([torch.zeros(1, requires_grad=True)]).step()
mark("first optimiser step (torch._dynamo)")
torch.cuda.init()
mark("torch.cuda.init")
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
mark("first CUDA tensor (context)")
model = models.create("fc_deq_tiny", in_shape=(8,), num_outputs=3).cuda()
x = torch.randn(4, 8, device="cuda")
mark("model to GPU")
model(x).square().sum().backward()
torch.cuda.synchronize()
mark("first forward/backward")
opt = torch.optim.Adam(model.parameters())
opt.step()
torch.cuda.synchronize()
mark("first Adam step on GPU")
with torch.no_grad():
    model.eval()
    model(x)
torch.cuda.synchronize()
mark("eval pass")
t = time.perf_counter()
took = task.warm_up("cuda", torch.float32)
mark(f"warm_up() afterwards (returned {took})")
prev = T0
for name, at in marks:
    print(f"{name:45s} {at - prev:7.3f} s   (at {at - T0:6.2f} s)")
    prev = at
