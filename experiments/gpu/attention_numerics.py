#!/usr/bin/env python3
"""The roundings of pipe's tensor-core attention (kernels.cu, `attention_mma_64` and its two
backward passes), emulated in numpy on the CPU, against the f64 definition of causal attention
and its gradient. Run: `python3 experiments/gpu/attention_numerics.py` (numpy only).

What the kernels round: q, k, v and the output gradient to bf16 (nearest even); the softmax
weights P (f32, from f32 scores) to bf16 before P V and P^T dO, tile by tile of 64 keys against
the running maximum; the score gradients dS to bf16 before dS K and dS^T Q. Products
accumulate in f32; delta = rowsum(dO * O) is f32 from the f32 tensors. The inputs are the
backend suite's (`cuda_bf16_attention_matches_the_f64_definition`: the same LCG, seeds 31 and
32, the same shapes and spreads; and `cuda_bf16_attention_masks_packed_documents`, packed
documents masked as the kernels mask them).

Prints, per shape, the worst error over each tensor's root mean square (output, whole
gradient) and the worst absolute log-sum-exp error: against the definition at the unrounded
inputs, and at the bf16-rounded inputs the kernels compute from (the test's reference). The
unrounded column is what the H200 printed for the test's first version, to three digits.
"""
import numpy as np
MASK = (1 << 64) - 1


def lcg(n, seed):
    """The backend suite's inputs (`lcg` in kernels/tests/backend.rs)."""
    s=(seed*6364136223846793005+1442695040888963407)& MASK
    out=np.empty(n,dtype=np.float32)
    for i in range(n):
        s=(s*6364136223846793005+1442695040888963407)& MASK
        out[i]=np.float32((s>>40)/float(1<<24))*np.float32(2.0)-np.float32(1.0)
    return out

def bf16(x):
    """f32 rounded to bf16, nearest even (as `to_bf16`), kept as f32."""
    x=np.asarray(x,dtype=np.float32)
    b=x.view(np.uint32).astype(np.uint64)
    r=((b+0x7fff+((b>>16)&1))>>16)<<16
    return r.astype(np.uint32).view(np.float32)

def hidden(T,starts):
    """Where row i does not see key j: after it (causal), or before its document's start."""
    i,j=np.arange(T)[:,None],np.arange(T)[None,:]
    return (j>i)|(j<starts[:,None])

def ref(q,k,v,go,starts):
    """The f64 definition for one sequence and head (q, k, v, go: [T, D]; starts: [T], where each
    row's document starts): out, lse, dq, dk, dv."""
    T,D=q.shape; sc=1/np.sqrt(D)
    s=(q@k.T)*sc; s[hidden(T,starts)]=-np.inf
    m=s.max(1,keepdims=True); p=np.exp(s-m); z=p.sum(1,keepdims=True); p/=z
    o=p@v; lse=(m+np.log(z))[:,0]
    dp=go@v.T; dl=(p*dp).sum(1,keepdims=True); ds=p*(dp-dl)*sc
    return o,lse,ds@k,ds.T@q,p.T@go

def kernel(q32,k32,v32,go32,starts):
    """The kernels' roundings for one sequence and head, tile by tile as they run. A row whose
    maximum is still -inf (no key of its document seen yet) takes its exponents against 0
    (the forward's `pivot`), so a tile of keys all before its document adds nothing."""
    T,D=q32.shape; sc=np.float32(1/np.sqrt(D)); L2=np.float32(1.4426950408889634); tl=sc*L2
    q,k,v,go=bf16(q32),bf16(k32),bf16(v32),bf16(go32)
    o=np.zeros((T,D),np.float32); m=np.full(T,-np.inf,np.float32); l=np.zeros(T,np.float32)
    mask=hidden(T,starts)
    with np.errstate(invalid="raise"):
        for k0 in range(0,T,64):
            keys=np.arange(k0,min(k0+64,T))
            s=(q@k[keys].T).astype(np.float32)*tl
            s[mask[:,keys]]=-np.inf
            top=np.maximum(m,s.max(1)); pivot=np.where(top==-np.inf,np.float32(0),top)
            corr=np.exp2(m-pivot)
            p=np.exp2(s-pivot[:,None]).astype(np.float32)
            l=l*corr+p.sum(1); o=o*corr[:,None]+bf16(p)@v[keys]; m=top
    out=o/l[:,None]; lse=(m+np.log2(l))*np.float32(0.6931471805599453)
    delta=(go32*out).sum(1).astype(np.float32)
    s=(q@k.T).astype(np.float32)*tl
    p=np.exp2(s-(lse*L2)[:,None]); p[mask]=0
    dp=(go@v.T).astype(np.float32); ds=(p*(dp-delta[:,None])*sc).astype(np.float32)
    dq=bf16(ds)@k; dk=bf16(ds).T@q; dv=bf16(p).T@go
    return out,lse,dq,dk,dv

def case(batch,seq,heads,width,spread,documents=None):
    """One shape; `documents`, per sequence, its documents as [start, end) ranges (None: one
    document a sequence)."""
    D=width//heads; rows=batch*seq
    qkv=(lcg(rows*3*width,31)*np.float32(spread)).reshape(rows,3*width)
    dout=lcg(rows*width,32).reshape(rows,width)
    res={}
    for name,rnd in [("unrounded",lambda x:x.astype(np.float64)),("rounded",lambda x:bf16(x).astype(np.float64))]:
        O=[];Og=[];L=[];Lg=[];G=[];Gg=[]
        for b in range(batch):
            for h in range(heads):
                sl=slice(b*seq,(b+1)*seq)
                starts=np.zeros(seq,dtype=np.int64)
                for (s0,e0) in (documents[b] if documents else []):
                    starts[s0:e0]=s0
                q=qkv[sl,h*D:(h+1)*D];k=qkv[sl,width+h*D:width+(h+1)*D];v=qkv[sl,2*width+h*D:2*width+(h+1)*D];go=dout[sl,h*D:(h+1)*D]
                o,lse,dq,dk,dv=ref(rnd(q),rnd(k),rnd(v),rnd(go),starts)
                ko,kl,kdq,kdk,kdv=kernel(q,k,v,go,starts)
                O.append(o);Og.append(ko);L.append(lse);Lg.append(kl);G+= [dq,dk,dv];Gg+=[kdq,kdk,kdv]
        def worst(a,b):
            a=np.concatenate([x.ravel() for x in a]);b=np.concatenate([x.ravel() for x in b]).astype(np.float64)
            rms=np.sqrt((a*a).mean()); return np.abs(a-b).max()/rms
        lse_err=np.abs(np.concatenate(L)-np.concatenate(Lg)).max()
        res[name]=(worst(O,Og),worst(G,Gg),lse_err)
    what=(batch,seq,heads,width,spread)+(("documents",) if documents else ())
    print(what,{k:tuple(f"{x:.2e}" for x in v) for k,v in res.items()})


def main():
    # (batch, seq, heads, width, spread): the backend suite's shapes.
    for shape in [(1, 1, 1, 64, 1.0), (2, 70, 2, 128, 2.0), (1, 200, 3, 192, 3.0), (1, 256, 1, 64, 1.0)]:
        case(*shape)
    # `cuda_bf16_attention_masks_packed_documents`: documents past the first key tile.
    case(2, 200, 2, 128, 2.0, [[(0, 20), (20, 130), (130, 200)],
                               [(0, 5), (5, 70), (70, 71), (71, 200)]])


if __name__ == "__main__":
    main()
