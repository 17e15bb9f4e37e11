import torch, time
torch.manual_seed(0)
def bench(f, n=20):
    f(); f(); t=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t)/n*1e3
tot = {}
X = torch.randn(128, 1536)
for (N,K,cnt) in [(960,576,30),(576,576,30),(3072,576,30),(576,1536,30),(49152,576,1)]:
    W = torch.randn(N,K) * K**-0.5
    packs = {h: torch.ops.mkldnn._reorder_linear_weight(W, h) for h in (1, 32)}
    lin = lambda x, h: torch.ops.mkldnn._linear_pointwise(x, packs[h], None, "none", [], "")
    full = lin(X[:64, :K].contiguous(), 32)
    for M in (1, 2, 8, 32, 64):
        x = X[:M, :K].contiguous()
        r = dict(F=bench(lambda: torch.nn.functional.linear(x, W)),
                 skinny=bench(lambda: (W @ x.t()).t().contiguous()),
                 dnn1=bench(lambda: lin(x, 1)), dnn32=bench(lambda: lin(x, 32)))
        for k, v in r.items(): tot[(M, k)] = tot.get((M, k), 0) + v * cnt
        inv = torch.equal(lin(x, 32), full[:M])
        eqF = torch.equal(lin(x, 32), torch.nn.functional.linear(x, W))
        print(N, K, M, {k: round(v, 3) for k, v in r.items()}, "row-invariant", inv, "==F.linear", eqF)
for M in (1, 2, 8, 32, 64):
    print("step matmuls M=", M, {k: round(tot[(M, k)], 1) for k in ("F", "skinny", "dnn1", "dnn32")})
