import torch, sys
sys.path.insert(0, ".")
from tests.kernels import test_pdl as T
from flexspec_kernels import pdl, skinny_linear as sk
g = torch.Generator(device="cuda").manual_seed(0)
def rand(*s): return (torch.randn(*s, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
hidden, inter, vocab, L = 576, 1536, 8192, 24
layers = [(1 + rand(hidden), rand(2 * inter, hidden), rand(hidden, inter)) for _ in range(L)]
logits_w = rand(vocab, hidden)
inputs = [rand(4, hidden) * 20 for _ in range(40)]
def run(on, preload_flag):
    pdl.PDL = on; sk.DOT_PRELOAD = preload_flag
    h = inputs[0].clone(); T._decoder_chain(h, layers, logits_w, "dot"); torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr): tok = T._decoder_chain(h, layers, logits_w, "dot")
    outs = []
    for x in inputs:
        h.copy_(x); gr.replay(); outs.append((h.clone(), tok.clone()))
    torch.cuda.synchronize(); return outs
def cmp(a, b, name):
    hd = max((x[0].float() - y[0].float()).abs().max().item() for x, y in zip(a, b))
    same = all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    tok = sum(int((x[1] != y[1]).sum()) for x, y in zip(a, b))
    print(f"{name}: bit-identical {same}, max |dh| {hd:.4g}, token mismatches {tok}", flush=True)
on_pre = run(True, True); on_pre2 = run(True, True); off = run(False, True); on_nopre = run(True, False)
cmp(on_pre, on_pre2, "PDL+preload vs PDL+preload (determinism)")
cmp(on_nopre, off, "PDL no-preload vs no PDL (same tiling)")
cmp(on_pre, off, "PDL+preload vs no PDL (tiling differs)")
