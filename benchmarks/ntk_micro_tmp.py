import time, torch, statistics, deqbench
from torch.func import vjp
from deqbench.ntk import prepare
from deqbench.solvers import get
dev = "cuda"
torch.manual_seed(0)
m = deqbench.models.create("fc_deq", in_shape=(32,), num_outputs=1, width=300).to(dev).eval()
with torch.no_grad():
    W = m.deq.cell.W.weight; W.mul_(0.7 / torch.linalg.matrix_norm(W, ord=2))
def tm(fn, r=10):
    for _ in range(3): fn()
    ts=[]
    for _ in range(r):
        a,b=torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for N in [512, 2048]:
    X = torch.randn(N, 32, device=dev)
    with torch.no_grad():
        u = m.inject(X); z0 = torch.zeros_like(u)
    cell = m.deq.cell
    fp = get("fixed_point")
    for opts in [{"check_every": 60}, {"check_every": 60, "returns": "last"}, {"returns": "last"}, {}]:
        print(N, "fwd", opts, tm(lambda: fp(lambda z: cell(z, u), z0, max_iter=60, tol=0.0, **opts)))
    def plain():
        with torch.no_grad():
            z = z0
            for _ in range(60): z = cell(z, u)
        return z
    print(N, "bare 60 iters", tm(plain))
    z = plain(); g = torch.randn_like(z)
    with torch.no_grad():
        _, vf = vjp(lambda zz: cell(zz, u), z)
    def a1():
        with torch.no_grad():
            w = g
            for _ in range(60): w = vf(w)[0] + g
    print(N, "func.vjp 60", tm(a1))
    with torch.enable_grad():
        zq = z.detach().requires_grad_(True); fq = cell(zq, u)
    def a2():
        w = g
        for _ in range(60): w = torch.autograd.grad(fq, zq, w, retain_graph=True)[0] + g
    print(N, "autograd.grad 60", tm(a2))
    with torch.no_grad():
        a = cell.W(z) + u; s = 1 - torch.tanh(a)**2
    Wt = cell.W.weight
    def a3():
        w = g
        for _ in range(60): w = (s * w) @ Wt + g
    print(N, "explicit 60", tm(a3))
    K = torch.randn(N, N, dtype=torch.float64, device=dev); K = K @ K.T
    print(N, "eigvalsh cusolver", tm(lambda: torch.linalg.eigvalsh(K)))
    try:
        torch.backends.cuda.preferred_linalg_library("magma")
        print(N, "eigvalsh magma", tm(lambda: torch.linalg.eigvalsh(K)))
    except Exception as e: print("magma", e)
    torch.backends.cuda.preferred_linalg_library("default")
    print(N, "eigvalsh cpu", tm(lambda: torch.linalg.eigvalsh(K.cpu())))
