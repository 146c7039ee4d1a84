"""How far the states that dq needs drift when a reverse sweep rebuilds them from the forward's saved
segment states (S_c = S_{c+1} - K_c^T V_c in fp32) instead of carrying them forward, against float64:
relative RMS of do S_c^T over the whole sequence and over its first 16 chunks (the smallest states).
One head, T = 65536, K = V = 128, 64-token chunks, bf16-rounded k and v, elu1 and identity features;
segments of 1024 chunks (the whole sequence) and of 128. CPU, ~1 minute.
    python scripts/rebuilt_states_error.py
"""
import torch

torch.manual_seed(0)
T,K,V,C=65536,128,128,64
for fm in ("elu1","identity"):
  k=torch.randn(T,K,dtype=torch.float64); v=torch.randn(T,V,dtype=torch.float64); do=torch.randn(T,V,dtype=torch.float64)
  if fm=="elu1": k=torch.nn.functional.elu(k)+1
  k32,v32=k.bfloat16().float(),v.bfloat16().float()
  kd,vd=k32.double(),v32.double()
  n=T//C
  inc32=torch.einsum('ncK,ncV->nKV',k32.view(n,C,K),v32.view(n,C,V))  # fp32 chunk products
  incd=torch.einsum('ncK,ncV->nKV',kd.view(n,C,K),vd.view(n,C,V))
  Sd=torch.cumsum(incd,0)-incd   # exact state before each chunk
  # forward fp32 accumulation
  Sf=torch.zeros(K,V); fwd=[]
  for c in range(n): fwd.append(Sf.clone()); Sf=Sf+inc32[c]
  fwd=torch.stack(fwd)
  for seg in (n, n//8):
    # reverse rebuild within segments of `seg` chunks from the forward's state at each segment end
    rev=torch.empty_like(fwd)
    for s0 in range(0,n,seg):
      S=fwd[s0+seg] if s0+seg<n else Sf
      for c in range(s0+seg-1,s0-1,-1):
        S=S-inc32[c]; rev[c]=S
    dod=do.view(n,C,V)
    ref=torch.einsum('ncV,nKV->ncK',dod,Sd)
    for name,St in (("forward fp32",fwd),("rebuilt",rev)):
      dq=torch.einsum('ncV,nKV->ncK',dod,St.double())
      err=(dq-ref); rel=err.norm()/ref.norm()
      early=(err[:16].norm()/ref[:16].norm()).item()
      print(f"{fm:8s} seg={seg:5d} {name:13s} rel rms {rel.item():.2e}  first 16 chunks {early:.2e}")
