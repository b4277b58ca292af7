"""Compile every Triton kernel of kvserve for sm_90 (H200) down to a cubin, without a GPU.

Run by tests/test_triton_compile.py in a subprocess without TRITON_INTERPRET: the interpreter
accepts code that the real compiler rejects (types, layouts, shared memory), and this machine
has no GPU to find out on. Usage: python tests/triton_aot.py
"""
import time
import triton
from triton.compiler import ASTSource, compile as tcompile
from triton.backends.compiler import GPUTarget
from kvserve.attention import triton_kernels as tk
from kvserve.kernels.gpu import ops as gpu_ops

target = GPUTarget("cuda", 90, 32)

def build(fn, types, constexprs, name):
    sig = {}
    argnames = fn.arg_names
    for a in argnames:
        if a in constexprs:
            sig[a] = "constexpr"
        else:
            sig[a] = types[a]
    src = ASTSource(fn=fn, signature=sig, constexprs={(argnames.index(k),): v for k, v in constexprs.items()})
    t0 = time.time()
    k = tcompile(src, target=target, options={"num_warps": 4, "num_stages": 2})
    assert k.asm.get("cubin"), name
    assert k.metadata.shared <= 227 * 1024, (name, k.metadata.shared)  # H100/H200 per block
    print(f"ok {name} {time.time() - t0:.1f}s shared={k.metadata.shared}", flush=True)

def ints(names, t="i32"):
    return {n: t for n in names}

def quant(cache_t, sz_t, kind):
    """The QuantKV arguments of the attention kernels (tk.QuantKV.args / constexprs)."""
    types = {"k_sz": sz_t, "v_sz": sz_t, "k_scale": "fp32", "v_scale": "fp32"}
    types.update(ints(["ksz_b", "ksz_s", "ksz_h", "vsz_b", "vsz_s", "vsz_h"]))
    return types, tk.QuantKV(kind, group_dim=64 if kind == tk.KV_INT8 else 1 << 30).constexprs()

def attention(dt, cache_t, sz_t, kind, label, lens_types=("*i32", "*i64")):
    ieee = dt == "fp32"
    qtypes, qconst = quant(cache_t, sz_t, kind)
    for lens_t in lens_types:
        types = {"q_ptr": f"*{dt}", "k_cache": cache_t, "v_cache": cache_t, "tables": "*i32", "seq_lens": lens_t, "mid_o": "*fp32", "mid_lse": "*fp32", "qk_scale": "fp32", "window": "i32", **qtypes}
        types.update(ints(["stride_qt","stride_qh","stride_kcb","stride_kcs","stride_kch","stride_vcb","stride_vcs","stride_vch","stride_tb","stride_mob","stride_moh","stride_mos","stride_mlb","stride_mlh"]))
        build(tk._decode_split_kernel, types, dict(GROUP=7, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, BLOCK_SIZE=16, NUM_SPLITS=8, IEEE=ieee, **qconst), f"decode {dt}{label} lens {lens_t}")
    types = {"q_ptr": f"*{dt}", "k_cache": cache_t, "v_cache": cache_t, "out_ptr": f"*{dt}", "tables": "*i32", "q_starts": "*i32", "q_lens": "*i32", "seq_lens": "*i32", "qk_scale": "fp32", "window": "i32", **qtypes}
    types.update(ints(["stride_qt","stride_qh","stride_ot","stride_oh","stride_kcb","stride_kcs","stride_kch","stride_vcb","stride_vcs","stride_vch","stride_tb"]))
    build(tk._extend_kernel, types, dict(GROUP=7, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64 if dt != "fp32" else 32, BLOCK_SIZE=16, IEEE=ieee, **qconst), f"extend {dt}{label}")

for dt in ("bf16", "fp32"):
    ieee = dt == "fp32"
    # store
    types = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "k_cache": f"*{dt}", "v_cache": f"*{dt}", "slot_ptr": "*i64"}
    types.update(ints(["stride_kt","stride_kh","stride_vt","stride_vh","stride_kcb","stride_kcs","stride_kch","stride_vcb","stride_vcs","stride_vch"]))
    build(tk._store_kv_kernel, types, dict(NUM_KV_HEADS=4, HEAD_DIM=128, BLOCK_H=4, BLOCK_D=128, BLOCK_SIZE=16), f"store {dt}")
    types = {"mid_o": "*fp32", "mid_lse": "*fp32", "out_ptr": f"*{dt}"}
    types.update(ints(["stride_mob","stride_moh","stride_mos","stride_mlb","stride_mlh","stride_ot","stride_oh"]))
    build(tk._decode_merge_kernel, types, dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=8, BLOCK_S=8), f"merge {dt}")
    attention(dt, f"*{dt}", f"*{dt}", tk.KV_PLAIN, "")
    types = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "eps": "fp32"}
    types.update(ints(["stride_xt","stride_xh","stride_wh","stride_ot","stride_oh"]))
    build(gpu_ops._rms_norm_kernel, types, dict(N=3584, BLOCK=4096, HAS_WEIGHT=True), f"rms {dt}")
    types = {"x_ptr": f"*{dt}", "cs_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
    types.update(ints(["stride_xt","stride_xh","stride_cs","stride_ot","stride_oh"]))
    build(gpu_ops._rope_kernel, types, dict(HALF=64, BLOCK=64), f"rope {dt}")
    types = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"}
    types.update(ints(["stride_xt","stride_ot"]))
    build(gpu_ops._silu_mul_kernel, types, dict(N=18944, BLOCK=1024), f"silu {dt}")
# Quantized caches (uint8 bytes): int8 with its fp16 scale/zero parts, fp8 (e4m3, e5m2).
attention("bf16", "*u8", "*fp16", tk.KV_INT8, " int8", ("*i32",))
attention("bf16", "*u8", "*u8", tk.KV_FP8_E4M3, " fp8", ("*i32",))
attention("bf16", "*u8", "*u8", tk.KV_FP8_E5M2, " fp8_e5m2", ("*i32",))
types = {"cache_ptrs": "*i64", "src_ptr": "*i64", "dst_ptr": "*i64"}
build(tk._copy_blocks_kernel, types, dict(BLOCK_NUMEL=16*4*128, CHUNK=4096, ELEM_BITS=16), "copy")
