"""Experiment (session 26, reverted with the batch split): the dense step of the synthetic CTR
MLP on one torch thread, two OpenMP threads, or two Python threads over row chunks; wall and CPU
ms per step. ``python split_step_probe.py one|omp2|chunk BATCH CHUNKS``; ``load.py ON_MS OFF_MS``
puts a bursty load on CPU 1."""
import os, sys, time, threading, queue
import torch, torch.nn as nn
mode = sys.argv[1]; bs = int(sys.argv[2]); chunks = int(sys.argv[3]) if len(sys.argv) > 3 else 4
hidden = tuple(int(x) for x in os.environ.get("HID", "400,400,400").split(","))
torch.set_flush_denormal(True)
torch.set_num_threads(2 if mode == "omp2" else 1)
os.sched_setaffinity(0, {0})  # training thread on CPU 0
torch.manual_seed(0)
layers = []; w = 13 + 26 * 16
for h in hidden: layers += [nn.Linear(w, h), nn.ReLU()]; w = h
layers.append(nn.Linear(w, 1)); model = nn.Sequential(*layers)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
x = torch.randn(bs, 13 + 26 * 16); y = (torch.rand(bs, 1) < 0.25).float()
emb_leaf = torch.randn(bs, 26 * 16, requires_grad=True)

def fwd_bwd(xc, ec, yc, scale):
    out = torch.sigmoid(model(torch.cat([xc[:, :13], ec], 1)))
    loss = nn.functional.binary_cross_entropy(out, yc, reduction="sum") * scale
    loss.backward()

work = queue.Queue(); done = queue.Queue()
def helper():
    os.sched_setaffinity(0, {1})
    torch.set_flush_denormal(True)
    while True:
        item = work.get()
        if item is None: return
        cs = item
        while True:
            try: c = cs.pop()
            except IndexError: break
            c()
        done.put(1)
if mode == "chunk":
    t = threading.Thread(target=helper, daemon=True); t.start()

def step():
    if mode != "chunk":
        out = torch.sigmoid(model(torch.cat([x[:, :13], emb_leaf], 1)))
        nn.functional.binary_cross_entropy(out, y).backward()
    else:
        emb = emb_leaf * 1.0
        n = bs // chunks
        grads = [None] * chunks
        def make(i):
            def run():
                ec = emb[i*n:(i+1)*n].detach().requires_grad_()
                fwd_bwd(x[i*n:(i+1)*n], ec, y[i*n:(i+1)*n], 1.0 / bs)
                grads[i] = ec.grad
            return run
        cs = [make(i) for i in reversed(range(chunks))]
        work.put(cs)
        while True:
            try: c = cs.pop()
            except IndexError: break
            c()
        done.get()
        emb.backward(torch.cat(grads))
    opt.step(); opt.zero_grad(set_to_none=True); emb_leaf.grad = None

for _ in range(20): step()
N = int(os.environ.get("N", 200)); t0 = time.perf_counter(); c0 = time.process_time()
for _ in range(N): step()
dt = (time.perf_counter() - t0) / N; cpu = (time.process_time() - c0) / N
print(f"{mode} bs={bs} chunks={chunks}: {dt*1e3:.2f} ms/step, {cpu*1e3:.2f} ms CPU/step, {bs/dt:,.0f} samples/s")
