"""The sampler's Triton kernels compile for a Hopper GPU, checked on the CPU: the interpreter that runs
the kernel tests here does not type-check a kernel the way the compiler does (a loop-carried value
that changes type, a name rebound to another type in one branch), so a kernel could pass every CPU
test and fail on its first GPU launch (the winner-first sampler did, once)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from rosecli.kernels import sampling as K

    PTR = {"x_ptr": "*fp32", "slot_ptr": "*i64", "f_ptr": "*fp32", "i_ptr": "*i64", "step_ptr": "*i64",
           "pmax_ptr": "*fp32", "pidx_ptr": "*i32", "pmin_ptr": "*fp32", "piv_ptr": "*fp32", "pc_ptr": "*i32",
           "pm_ptr": "*fp32", "pz_ptr": "*fp32", "cx_ptr": "*fp32", "ci_ptr": "*i32", "rs_ptr": "*fp32",
           "ri_ptr": "*i64", "rs2_ptr": "*fp32", "ri2_ptr": "*i64", "out_ptr": "*i64", "tau_ptr": "*fp32",
           "fb_ptr": "*i32", "cnt_ptr": "*i32"}

    def build(fn, consts):
        names = fn.arg_names
        sig = {n: "constexpr" if n in consts else PTR.get(n, "i32") for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", 90, 32))

    common = dict(SP2=16, P=K.PIVOTS, PDL=True)  # (as a Hopper launches them: `kernels.pdl`)
    build(K._pass1_kernel, dict(PEN=True, PROMPT=K.PROMPT_BIT, BLOCK=K.SPLIT_BLOCK, PDL=True))
    for winner in (False, True):  # (want_tau, and not)
        build(K._pivot_kernel, dict(common, PB=K.PIVOT_BLOCK, WINNER=winner))
        build(K._compact_kernel, dict(common, BLOCK=K.SPLIT_BLOCK, WINNER=winner))
        build(K._finish_kernel, dict(common, PB=K.PIVOT_BLOCK, BLOCK=K.BLOCK, REFINE=K.REFINE, WINNER=winner,
                                     TRIES=K.TRIES, SMALL=K.FINISH_TILE))
    for stage in range(3):
        build(K._above_kernel, dict(common, BLOCK=K.SPLIT_BLOCK, STAGE=stage))
    print("compiled")
''')


def test_sampling_kernels_compile_for_hopper():
    env = dict(os.environ, TRITON_INTERPRET="0")  # (compiled: `triton.jit` functions, not the interpreter's)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
