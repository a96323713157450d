"""Operators compiled from IR at run time (abp.compile_operators → libabp_compiler.so).

The new operator goes through the same pipeline, emitter and runtime as the op library; these
tests check that it computes what its IR says (forward exactly, backward levels[code] * dy
bit-identically on CPU fp32), saves only its packed codes, and that bad IR and name clashes give
located, named errors.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import abp
from abp import AbpError, Status
from abp_reference import compiler_or_skip

CUBE_IR = """
#t = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [3.0, 0.5, 0.25, 3.0]>
func.func private @cube(%x: f32) -> f32 {
  %a = arith.mulf %x, %x : f32
  %b = arith.mulf %a, %x : f32
  return %b : f32
}
func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}
abp.operator @test_cube forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @cube(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #t} : tensor<?xf32> -> !abp.codes<2>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #t} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
"""


@pytest.fixture(scope="module")
def cube() -> str:
    compiler_or_skip()
    names = abp.compile_operators(CUBE_IR, origin="cube.mlir")
    assert names == ["test_cube"]
    return names[0]


def test_inspect_shows_the_compiled_operator(cube: str) -> None:
    # Its manifest and source live in the compile's own directory, not the op library's.
    info = abp.inspect(cube)
    assert Path(info["manifest_path"]).parent != abp.kernel_dir()
    assert info["operator"]["name"] == cube and "abp_test_cube" in info["source"]
    assert info["ir"] == CUBE_IR  # the text it was compiled from


def test_forward_is_the_ir_function(cube: str) -> None:
    x = torch.randn(1001)
    y = abp.functional.apply(cube, x)
    assert torch.equal(y, x * x * x)


def test_backward_is_levels_of_code_times_dy(cube: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(1003) * 2
    x[:4] = torch.tensor([-1.0, 0.0, 1.0, float("nan")])
    xr = x.clone().requires_grad_(True)
    dy = torch.randn(1003)
    abp.functional.apply(cube, xr).backward(dy)
    borders = torch.tensor([-1.0, 0.0, 1.0])
    levels = torch.tensor([3.0, 0.5, 0.25, 3.0])
    code = (x.unsqueeze(1) > borders).sum(1)  # NaN compares false: code 0
    assert torch.equal(xr.grad, levels[code] * dy)


def test_saves_only_packed_codes(cube: str) -> None:
    x = torch.randn(1001, requires_grad=True)
    assert abp.memory.saved_bytes(lambda t: abp.functional.apply(cube, t), x) == math.ceil(2 * 1001 / 8)


def test_compiling_again_is_idempotent(cube: str) -> None:
    assert abp.compile_operators(CUBE_IR, origin="cube.mlir") == [cube]


def test_a_compiled_operator_runs_as_a_module(cube: str) -> None:
    """abp.nn.Apply: an IR operator (or a library one) as a stateless module in a model, its
    parameters fixed by position or by name and checked against the manifest's."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), abp.nn.Apply(cube), torch.nn.Linear(8, 2))
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model[2](abp.functional.apply(cube, model[0](x))).square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    two = LEAKY_IR.replace("PARAMS", '["slope", "shift"]').replace("%s: f32)", "%s: f32, %t: f32)")
    names = abp.compile_operators(two.replace("@test_leaky_params", "@test_two_params"), origin="two.mlir")
    named = abp.nn.Apply(names[0], 0.5, shift=2)
    assert named.params == (0.5, 2.0) and repr(named) == f"Apply('{names[0]}', slope=0.5, shift=2)"
    assert torch.equal(named(x), x)
    for args, kwargs, message in [((), {}, r"missing \['slope', 'shift'\]; its parameters are \['slope', 'shift'\]"),
                                  ((1.0,), {"slop": 2}, r"unexpected keyword argument 'slop'; its arguments are \['slope', 'shift'\]"),
                                  ((1.0, 2.0), {"slope": 1}, "got 'slope' both by position and by keyword"),
                                  ((1.0, 2.0, 3.0), {}, r"takes \['slope', 'shift'\], got 3 positional argument\(s\)"),
                                  ((1.0, "a"), {}, "shift: expected a number, got str")]:
        with pytest.raises(TypeError, match=message):
            abp.nn.Apply(names[0], *args, **kwargs)
    with pytest.raises(AbpError, match="abp has no operator 'no_such_op'"):
        abp.nn.Apply("no_such_op")


def test_bad_ir_reports_origin_line_and_column() -> None:
    compiler_or_skip()
    bad = CUBE_IR.replace("@test_cube", "@test_bad").replace("levels = [3.0, 0.5, 0.25, 3.0]", "levels = [3.0, 0.5, 0.25]")
    with pytest.raises(AbpError) as info:
        abp.compile_operators(bad, origin="model.py:42")
    assert info.value.status == Status.COMPILE
    # The caller's file:line, then the place inside the IR text, without a run of colons.
    assert "model.py:42: IR line 2, column " in str(info.value)
    assert "power-of-two number of levels" in str(info.value)


def test_name_clash_with_the_op_library_is_refused() -> None:
    compiler_or_skip()
    clash = CUBE_IR.replace("@test_cube", "@relu")
    with pytest.raises(AbpError) as info:
        abp.compile_operators(clash, origin="clash.mlir")
    assert info.value.status == Status.INVALID_ARGUMENT
    assert "operator 'relu' (clash.mlir) is already defined, by the op library" in str(info.value)


def test_an_edited_operator_names_both_definitions(cube: str) -> None:
    edited = CUBE_IR.replace("arith.mulf", "arith.addf", 1)
    assert edited != CUBE_IR
    with pytest.raises(AbpError, match="operator 'test_cube' \\(cube_edited.mlir\\) is already defined, by "
                                       "cube.mlir; operators cannot be replaced"):
        abp.compile_operators(edited, origin="cube_edited.mlir")


LEAKY_IR = """
abp.operator @test_leaky_params attributes {params = PARAMS} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
"""

RECURSIVE_IR = """
func.func private @test_again(%x: f32) -> f32 {
  %y = func.call @test_again(%x) : (f32) -> f32
  return %y : f32
}
abp.operator @test_recursive forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @test_again(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
"""


@pytest.mark.parametrize("params, message", [
    ("[1]", "failed to satisfy constraint: string array attribute"),
    ("[[1]]", "failed to satisfy constraint: string array attribute"),
    ('"x"', "failed to satisfy constraint: string array attribute"),
    ('["a", "b", "c"]', "params names 3 parameter(s) but forward takes 1 scalar argument(s)"),
])
def test_malformed_params_are_located_errors_not_crashes(params: str, message: str) -> None:
    # Before the verifier checked them, codegen cast them unchecked: abp-compile and the user's
    # Python process died (SIGSEGV / abort).
    compiler_or_skip()
    with pytest.raises(AbpError) as info:
        abp.compile_operators(LEAKY_IR.replace("PARAMS", params), origin="leaky.mlir")
    assert info.value.status == Status.COMPILE
    assert "leaky.mlir:2:" in str(info.value) and message in str(info.value)


def test_deeply_nested_ir_is_a_located_error_not_a_stack_overflow() -> None:
    # MLIR's parser recurses per level: a few thousand levels overflowed the stack of the Python
    # process running compile_operators (SIGSEGV).
    compiler_or_skip()
    deep = "func.func private @f() attributes {a = " + "[" * 20000 + "]" * 20000 + "}\n"
    with pytest.raises(AbpError) as info:
        abp.compile_operators(deep, origin="deep.mlir")
    assert "deep.mlir:1:" in str(info.value) and "IR nested deeper than 256 levels" in str(info.value)
    fine = ("func.func private @f(%x: f32) -> f32 attributes {a = " + "[" * 100 + "]" * 100 + ", s = \"" + "[" * 300
            + "\"} {\n  return %x : f32\n}\n")
    with pytest.raises(ValueError, match="defines no abp.operator"):  # compiled (strings do not nest): no operator
        abp.compile_operators(fine, origin="fine.mlir")


def test_a_recursive_callee_is_refused_instead_of_looping_forever() -> None:
    compiler_or_skip()
    with pytest.raises(AbpError) as info:
        abp.compile_operators(RECURSIVE_IR, origin="rec.mlir")
    assert "rec.mlir:8:8:" in str(info.value) and "whose calls are recursive (@test_again -> @test_again)" in str(info.value)


def test_ir_must_be_text() -> None:
    with pytest.raises(TypeError, match="ir: expected the IR as a str"):
        abp.compile_operators(b"abp.operator")  # type: ignore[arg-type]


def test_a_nul_character_is_a_located_error_not_the_end_of_the_text() -> None:
    """The text crossed into C as a NUL-terminated string: IR then a NUL then anything compiled
    the IR and dropped the rest, binary data starting with NUL "compiled" to no operator, and a
    NUL inside an operator gave a parse error about what the cut left."""
    cut = CUBE_IR.replace("@test_cube", "@test_nul")
    at = cut.index("abp.operator")
    with pytest.raises(AbpError) as info:
        abp.compile_operators(cut[:at + 3] + "\0" + cut[at + 3:], origin="nul.mlir")
    line = cut.count("\n", 0, at) + 1
    column = at - cut.rfind("\n", 0, at)
    assert info.value.status == Status.COMPILE
    assert f"nul.mlir:{line}:{column + 3}: error: a NUL character (U+0000) in the IR text" in str(info.value)
    with pytest.raises(AbpError, match=r"model\.py:7: IR line 1, column 1: error: a NUL character"):
        abp.compile_operators("\0\x7fELF", origin="model.py:7")
    with pytest.raises(ValueError, match="origin: holds a NUL character"):
        abp.compile_operators(cut, origin="a\0b")


@pytest.mark.parametrize("ir", ["", "  \n", "// only a comment\n", "func.func @test_lone(%x: f32) -> f32 {\n  return %x : f32\n}\n"])
def test_ir_without_an_operator_says_so(ir: str) -> None:
    """Such text compiled to an empty list, and the caller's names[0] failed with an IndexError."""
    compiler_or_skip()
    with pytest.raises(ValueError, match=r"^empty\.mlir: the IR defines no abp\.operator"):
        abp.compile_operators(ir, origin="empty.mlir")


def test_missing_compiler_library_is_a_clear_error(tmp_path) -> None:
    code = (
        "import abp\n"
        "try:\n"
        "    abp.compile_operators('module {}', origin='x.mlir')\n"
        "except abp.AbpError as e:\n"
        "    print(int(e.status), str(e))\n"
    )
    env = dict(os.environ, ABP_COMPILER_LIBRARY=str(tmp_path / "missing.so"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith(f"{int(Status.NOT_FOUND)} "), out.stdout + out.stderr
    assert "ABP_ENABLE_COMPILER" in out.stdout and "apt install libllvm19" in out.stdout


_IR_CACHE_PROBE = (
    "import abp, pathlib\n"
    "abp.compile_operators(IR, origin='probe.mlir')\n"
    "print(abp._lib.kernel_library().directory_of('test_probe_cache'))\n"
)


def _compile_in_a_new_process(cache: Path, **extra: str) -> str:
    ir = CUBE_IR.replace("@test_cube", "@test_probe_cache")
    env = dict(os.environ, ABP_CACHE_DIR=str(cache), **extra)
    out = subprocess.run([sys.executable, "-c", f"IR = {ir!r}\n" + _IR_CACHE_PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1] + "\n" + out.stderr


def test_the_ir_cache_is_private_and_heals(tmp_path: Path) -> None:
    # Compiled IR is dlopen'ed: a cache directory another user can write into must not be used,
    # and a damaged entry is built again instead of breaking that IR in every later process.
    compiler_or_skip()
    cache = tmp_path / "cache"
    first = _compile_in_a_new_process(cache)
    entry = Path(first.splitlines()[0])
    assert entry.parent == cache / "ir" and (entry.parent.stat().st_mode & 0o777) == 0o700
    library = next(entry.glob("*.host.so"))
    library.write_bytes(library.read_bytes()[:100])  # truncated (a killed writer, a full disk)
    again = _compile_in_a_new_process(cache)
    assert Path(again.splitlines()[0]) == entry and library.stat().st_size > 100, "rebuilt in place"
    # The CUDA source too (what a GPU compiles and abp.inspect shows; it was outside the digest).
    source = next(entry.glob("*.cu"))
    whole = source.read_bytes()
    source.write_bytes(whole[: len(whole) // 2])
    _compile_in_a_new_process(cache)
    assert source.read_bytes() == whole, "rebuilt in place"
    # A compile killed before it published left its folder; a big old entry exceeds the limit.
    stale = cache / "ir" / "tmp-4194311-deadbeef"  # a pid above pid_max: no such process
    stale.mkdir()
    old = cache / "ir" / "ir_0000000000000000"
    old.mkdir()
    (old / "big.host.so").write_bytes(b"x" * (2 << 20))
    os.utime(old, (1, 1))
    library.write_bytes(b"")  # forces a compile
    _compile_in_a_new_process(cache, ABP_CACHE_MAX_MB="1")
    assert not stale.exists() and not old.exists() and entry.exists()
    # A call whose IR is cached cleans up too; a live process's folder (this one's) stays.
    stale.mkdir()
    live = cache / "ir" / f"tmp-{os.getpid()}-cafef00d"
    live.mkdir()
    _compile_in_a_new_process(cache)
    assert not stale.exists() and live.exists()
    live.rmdir()
    # An entry that became a plain file (it said "kernel directory ... does not exist" in every
    # later process, and stayed).
    shutil.rmtree(entry)
    entry.write_bytes(b"not a directory")
    assert Path(_compile_in_a_new_process(cache).splitlines()[0]) == entry and entry.is_dir()
    (cache / "ir").chmod(0o777)  # now anyone could plant a library there
    moved = _compile_in_a_new_process(cache)
    assert Path(moved.splitlines()[0]).parent != cache / "ir"
    assert "is writable by its group or by others" in moved  # the warning says why
    # A cache directory others may write into lets them move ir/ away and put their own in its
    # place between the compile and the first call, which loads the library (another user's
    # library ran in this process so).
    (cache / "ir").chmod(0o700)
    cache.chmod(0o777)
    moved = _compile_in_a_new_process(cache)
    assert Path(moved.splitlines()[0]).parent != cache / "ir"
    assert f"{cache} (above {cache / 'ir'}) is writable by its group or others (mode 777) and not sticky" in moved
    cache.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's descriptors in /proc")
def test_compiling_the_same_ir_again_holds_its_entry_once() -> None:
    # A process holds a lock on every entry it uses (below); compiling one IR again took another
    # descriptor each time (20 compiles, 20 descriptors), which a long authoring session runs out of.
    compiler_or_skip()
    ir = CUBE_IR.replace("@test_cube", "@test_held_once")
    abp.compile_operators(ir, origin="held.mlir")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        abp.compile_operators(ir, origin="held.mlir")
    assert len(os.listdir("/proc/self/fd")) <= before + 1


def test_a_size_limit_leaves_the_entries_of_compiled_operators_in_place(tmp_path: Path) -> None:
    """ABP_CACHE_MAX_MB removed the least recently written entries, also those of operators a
    process had compiled and not yet called (an operator's host library loads at its first
    call), which then failed with "cannot load the host kernel library". A process now holds
    every entry it uses, and no size limit removes one so held."""
    compiler_or_skip()
    first = CUBE_IR.replace("@test_cube", "@test_evict_first")
    second = CUBE_IR.replace("@test_cube", "@test_evict_second").replace("%x, %x", "%x, %x ")
    code = (
        "import abp, os, pathlib, torch\n"
        f"abp.compile_operators({first!r}, origin='first.mlir')\n"
        "entry = pathlib.Path(abp._lib.kernel_library().directory_of('test_evict_first'))\n"
        "(entry / 'ballast').write_bytes(b'x' * (2 << 20))  # the oldest entry, over the limit\n"
        "os.utime(entry, (1, 1))\n"
        f"abp.compile_operators({second!r}, origin='second.mlir')\n"
        "x = torch.arange(4.0)\n"
        "print(abp.functional.apply('test_evict_first', x).tolist(), entry.is_dir())\n"
    )
    env = dict(os.environ, ABP_CACHE_DIR=str(tmp_path / "cache"), ABP_CACHE_MAX_MB="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[0.0, 1.0, 8.0, 27.0] True"
    # Once no process holds it, the limit removes it.
    out = subprocess.run([sys.executable, "-c", f"import abp\nabp.compile_operators({first.replace('test_evict_first', 'test_evict_third')!r})"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not any((tmp_path / "cache" / "ir").glob("*/ballast"))



def test_a_disabled_cache_leaves_no_compiled_ir_behind(tmp_path: Path) -> None:
    # ABP_CACHE_DISABLE ("do not read or write the on-disk compile cache") held for NVRTC only:
    # compiled IR was written to $ABP_CACHE_DIR/ir and loaded from there by the next process.
    compiler_or_skip()
    cache = tmp_path / "cache"
    first = _compile_in_a_new_process(cache, ABP_CACHE_DISABLE="1")
    entry = Path(first.splitlines()[0])
    assert not (cache / "ir").exists() and not entry.exists(), "a per-process directory, removed at exit"
    assert "compiled IR is not cached" not in first and "no private cache directory" not in first  # no warning
    second = _compile_in_a_new_process(cache, ABP_CACHE_DISABLE="1")
    assert Path(second.splitlines()[0]) != entry


def test_the_fallback_directory_of_a_process_without_a_private_cache_is_removed_at_exit(tmp_path: Path) -> None:
    # Where neither $ABP_CACHE_DIR/ir nor <temp>/abp-ir-<uid> could be made private, a process
    # compiles into a fresh directory of its own, "for this process only" — which was left behind,
    # one directory of libraries per process.
    compiler_or_skip()
    temp = tmp_path / "temp"
    temp.mkdir()
    (temp / f"abp-ir-{os.getuid()}").write_text("a file where the shared directory would be")
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("")
    out = _compile_in_a_new_process(blocked, TMPDIR=str(temp))
    entry = Path(out.splitlines()[0])
    assert entry.parent.parent == temp and entry.parent.name.startswith("abp-ir-"), out
    assert "for this process only (removed at exit)" in out
    assert not entry.parent.exists()
    assert sorted(p.name for p in temp.iterdir()) == [f"abp-ir-{os.getuid()}"]


def test_a_rebuilt_compiler_does_not_reuse_the_cache(tmp_path: Path) -> None:
    # The IR cache is keyed by the compiler library's bytes too: a compiler rebuilt with another
    # pass or emitter (same version string) compiles the IR afresh instead of loading what the
    # old one generated.
    compiler_or_skip()
    from abp import _lib

    cache = tmp_path / "cache"
    first = Path(_compile_in_a_new_process(cache).splitlines()[0])
    _lib.native()
    library = Path(_lib._loaded_path or "").parent / "libabp_compiler.so"
    assert library.is_file(), library
    rebuilt = tmp_path / "libabp_compiler.so"
    rebuilt.write_bytes(library.read_bytes() + b"\0")  # another build: same code, other bytes
    second = Path(_compile_in_a_new_process(cache, ABP_COMPILER_LIBRARY=str(rebuilt)).splitlines()[0])
    assert second.parent == first.parent and second != first
    # Named by its soname, the library is found on the library path: the file dlopen loaded is
    # the one hashed (not a file of that name in the working directory).
    by_name = _compile_in_a_new_process(cache, ABP_COMPILER_LIBRARY="libabp_compiler.so",
                                        LD_LIBRARY_PATH=str(tmp_path))
    assert Path(by_name.splitlines()[0]) == second
    again = Path(_compile_in_a_new_process(cache).splitlines()[0])
    assert again == first, "the original compiler finds its own entry again"


NOISE_IR = """
abp.operator @test_noise attributes {params = ["seed", "offset"]} forward {
^bb0(%x: tensor<?xf32>, %seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?xf32>
  %y = abp.map(%x, %u) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.addf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}
"""


def test_uniform_in_an_elementwise_kernel_draws_philox_at_offset_plus_index() -> None:
    # abp.uniform outside a row kernel, with i64 parameters passed through the generic launch path.
    compiler_or_skip()
    import numpy as np

    from abp import _launch, _lib
    import gact_reference as ref

    if "test_noise" not in abp.operators():
        abp.compile_operators(NOISE_IR, origin="noise.mlir")
    op = _lib.kernel_library().operator("test_noise")
    seed, offset, n = (1 << 40) + 12345, 3, 1003  # an odd offset: draws position by position
    (y,), _ = _launch.forward(op, [torch.zeros(n)], [seed, offset])
    expected = ref.uniform_at(seed, np.arange(n, dtype=np.uint64) + np.uint64(offset))
    assert np.array_equal(y.numpy(), expected)
    (y2,), _ = _launch.forward(op, [torch.zeros(n)], [seed + 1, offset])
    assert not torch.equal(y, y2)


def test_16_bit_uniform_draws_half_words_of_philox() -> None:
    # abp.uniform {bits = 16}: half-word c mod 8 of the block c / 8 (the GACT quantizer's draws),
    # from an odd and an aligned offset. An elementwise kernel draws through uniform16At; the row
    # sweeps' uniform16Chunk is checked against it in DeviceHeaderTest and through the quantizer.
    compiler_or_skip()
    import numpy as np

    from abp import _launch, _lib
    import gact_reference as ref

    if "test_noise16" not in abp.operators():
        abp.compile_operators(NOISE_IR.replace("@test_noise", "@test_noise16")
                              .replace("%offset : i64, i64", "%offset {bits = 16 : i32} : i64, i64"),
                              origin="noise16.mlir")
    op = _lib.kernel_library().operator("test_noise16")
    seed, n = (1 << 40) + 12345, 1003
    for offset in (3, 16):
        (y,), _ = _launch.forward(op, [torch.zeros(n)], [seed, offset])
        expected = ref.uniform_at(seed, np.arange(n, dtype=np.uint64) + np.uint64(offset), bits=16)
        assert np.array_equal(y.numpy(), expected)
        assert np.all(y.numpy() * 65536 == np.floor(y.numpy() * 65536))  # on the 2^-16 grid
    # Not the 24-bit stream: the same position draws from another word.
    assert not np.array_equal(ref.uniform_at(seed, np.arange(64), bits=16), ref.uniform_at(seed, np.arange(64)))


SCALED_IR = """
func.func private @leaky(%x: f32, %slope: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %pos = arith.cmpf ogt, %x, %zero : f32
  %s = arith.mulf %x, %slope : f32
  %y = arith.select %pos, %x, %s : f32
  return %y : f32
}
abp.operator @test_leaky_operand attributes {params = ["slope"]} forward {
^bb0(%x: tensor<?xf32>, %slope: f32):
  %y = abp.map @leaky(%x, %slope) : (tensor<?xf32>, f32) -> tensor<?xf32>
  abp.return %y : tensor<?xf32> saves %x, %slope : tensor<?xf32>, f32
} backward {
^bb0(%x: tensor<?xf32>, %slope: f32, %dy: tensor<?xf32>):
  %dx = abp.map(%x, %dy, %slope) : (tensor<?xf32>, tensor<?xf32>, f32) -> tensor<?xf32> {
  ^bb0(%v: f32, %g: f32, %s: f32):
    %zero = arith.constant 0.0 : f32
    %pos = arith.cmpf ogt, %v, %zero : f32
    %sg = arith.mulf %g, %s : f32
    %r = arith.select %pos, %g, %sg : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?xf32>
}
"""


def test_a_parameter_can_be_a_map_operand() -> None:
    # The slope reaches the callee as its scalar argument and the body as a block argument:
    # no region capture needed.
    compiler_or_skip()
    if "test_leaky_operand" not in abp.operators():
        abp.compile_operators(SCALED_IR, origin="scaled.mlir")
    torch.manual_seed(0)
    x = torch.randn(1001, requires_grad=True)
    dy = torch.randn(1001)
    y = abp.functional.apply("test_leaky_operand", x, (0.125,))
    assert torch.equal(y, torch.where(x > 0, x, x * 0.125))
    y.backward(dy)
    assert torch.equal(x.grad, torch.where(x > 0, dy, dy * 0.125))


ROW_DROPOUT_IR = """
abp.operator @test_row_dropout attributes {params = ["seed", "offset"], no_grad = array<i64: 1>} forward {
^bb0(%x: tensor<?x?xf32>, %s: tensor<?xf32>, %seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?x?xf32>
  %sb = abp.broadcast_rows %s : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%x, %sb, %u) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %v: f32):
    %half = arith.constant 0.5 : f32
    %zero = arith.constant 0.0 : f32
    %keep = arith.cmpf olt, %v, %half : f32
    %p = arith.mulf %a, %b : f32
    %r = arith.select %keep, %p, %zero : f32
    abp.yield %r : f32
  }
  %m = abp.map(%u) : (tensor<?x?xf32>) -> tensor<?x?xi8> {
  ^bb0(%v: f32):
    %half = arith.constant 0.5 : f32
    %keep = arith.cmpf olt, %v, %half : f32
    %k = arith.extui %keep : i1 to i8
    abp.yield %k : i8
  }
  %c = abp.pack %m : tensor<?x?xi8> -> !abp.codes<1>
  %r = abp.reduce_rows sum %y : tensor<?x?xf32> -> tensor<?xf32>
  abp.return %y, %r : tensor<?x?xf32>, tensor<?xf32> saves %c, %s : !abp.codes<1>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<1>, %s: tensor<?xf32>, %dy: tensor<?x?xf32>, %dr: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?x?xi8>
  %sb = abp.broadcast_rows %s : tensor<?xf32> -> tensor<?x?xf32>
  %drb = abp.broadcast_rows %dr : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%m, %sb, %dy, %drb) : (tensor<?x?xi8>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%k: i8, %b: f32, %g: f32, %h: f32):
    %zero = arith.constant 0.0 : f32
    %none = arith.constant 0 : i8
    %on = arith.cmpi ne, %k, %none : i8
    %t = arith.addf %g, %h : f32
    %p = arith.mulf %t, %b : f32
    %r = arith.select %on, %p, %zero : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_autograd_path_runs_per_row_inputs_without_gradient_per_row_outputs_and_draws(dtype: torch.dtype) -> None:
    # One operator with everything the one launcher must bind: a per-row input listed in
    # no_grad, a per-row output, Philox draws keyed by i64 parameters, 1-bit codes.
    compiler_or_skip()
    import numpy as np

    from abp.autograd import OperatorFunction
    import gact_reference as ref

    if "test_row_dropout" not in abp.operators():
        abp.compile_operators(ROW_DROPOUT_IR, origin="row_dropout.mlir")
    seed, offset = (1 << 33) + 7, 5
    x = torch.randn(3, 4, 40).to(dtype).requires_grad_()  # codes of whole bytes per row
    s = torch.rand(12) + 0.5
    y, r = OperatorFunction.apply("test_row_dropout", (seed, offset), None, x, s)
    assert y.shape == x.shape and y.dtype == dtype and r.shape == (3, 4) and r.dtype == torch.float32
    keep = torch.from_numpy(ref.uniform_at(seed, np.arange(x.numel(), dtype=np.uint64) + np.uint64(offset)) < 0.5)
    keep = keep.reshape(x.shape)
    xs = x.detach().float() * s.reshape(3, 4, 1)
    torch.testing.assert_close(y.float(), torch.where(keep, xs, torch.zeros(())).to(dtype).float())
    torch.testing.assert_close(r, torch.where(keep, xs, torch.zeros(())).sum(-1), rtol=1e-5, atol=1e-5)
    gy, gr = torch.randn(x.shape).to(dtype), torch.randn(3, 4)
    torch.autograd.backward([y, r], [gy, gr])
    expected = torch.where(keep, (gy.float() + gr[..., None]) * s.reshape(3, 4, 1), torch.zeros(()))
    torch.testing.assert_close(x.grad.float(), expected.to(dtype).float())
    # The per-row input is checked like any argument, by its reference name.
    with pytest.raises(ValueError, match=r"test_row_dropout: input1 must be a contiguous torch.float32 tensor of one value per row \(12\)"):
        OperatorFunction.apply("test_row_dropout", (seed, offset), None, x, torch.rand(11))


# An affine MS-LayerNorm authored in IR (the lit test's operator): the gain and bias are
# per-column inputs (abp.broadcast_cols, #abp.cols), their gradients column sums
# (abp.reduce_cols), taken after the backward kernel.
AFFINE_IR = (Path(__file__).resolve().parents[1] / "lit" / "codegen" / "emit-rows-cols.mlir").read_text()


@pytest.fixture(scope="module")
def affine() -> str:
    compiler_or_skip()
    return abp.compile_operators(AFFINE_IR, origin="emit-rows-cols.mlir")[0]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("shape", [(4, 32), (3, 5, 100), (2, 1500), (1, 3)])
def test_per_column_inputs_and_their_column_sums_are_layer_norms_affine(affine: str, shape, dtype, tol) -> None:
    d = shape[-1]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.rand(d, generator=g, dtype=dtype) + 0.5).requires_grad_()
    b = torch.randn(d, generator=g, dtype=dtype).requires_grad_()
    y = abp.functional.apply(affine, (x, w, b), (1e-5,))
    want = torch.nn.functional.layer_norm(x, (d,), w, b, 1e-5)
    torch.testing.assert_close(y, want, rtol=0, atol=tol * 4)
    dy = torch.randn(want.shape, generator=g, dtype=dtype)
    got = torch.autograd.grad(y, (x, w, b), dy)
    exact = torch.autograd.grad(want, (x, w, b), dy)
    for name, a, e in zip(("dx", "dw", "db"), got, exact):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, rtol=0, atol=tol * max(1.0, e.abs().max().item()) * 8, msg=name)


def test_rows_of_no_columns_and_no_rows_give_empty_and_zero_column_sums(affine: str) -> None:
    for shape in ((4, 0), (0, 8)):
        x = torch.randn(*shape, requires_grad=True)
        w, b = torch.ones(shape[-1], requires_grad=True), torch.zeros(shape[-1], requires_grad=True)
        y = abp.functional.apply(affine, (x, w, b), (1e-5,))
        dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
        assert y.shape == x.shape and dx.shape == x.shape and dw.shape == db.shape == (shape[-1],)
        assert not dw.any() and not db.any()  # no rows: sums of nothing


def test_a_per_column_input_of_the_wrong_length_is_named(affine: str) -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"input1 must be a contiguous torch.float32 tensor of one value per column \(32\), "
                                         r"got torch.float32 with 31 elements"):
        abp.functional.apply(affine, (x, torch.ones(31), torch.zeros(32)), (1e-5,))
