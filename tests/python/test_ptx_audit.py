"""tools/ptx_audit.py on hand-written PTX: stream attribution, 128-bit coverage, the fast path.

The audit of the real kernels (every bundle compiled through NVRTC) is the `ptx-audit` ctest;
these check the analysis itself, so that a wrong attribution or a path through a rare branch
would fail here rather than silently pass there.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_TOOL = Path(__file__).resolve().parents[2] / "tools" / "ptx_audit.py"
_spec = importlib.util.spec_from_file_location("ptx_audit", _TOOL)
audit = importlib.util.module_from_spec(_spec)
sys.modules["ptx_audit"] = audit
_spec.loader.exec_module(audit)


def _entry(name: str) -> str:
    """An entry's head as NVRTC writes it: three u64 arguments, their loads into %rd1-%rd3."""
    params = ",\n".join(f"\t.param .u64 {name}_param_{i}" for i in range(3))
    loads = "".join(f"\tld.param.u64 \t%rd{i + 1}, [{name}_param_{i}];\n" for i in range(3))
    return (f"\n.visible .entry {name}(\n{params}\n)\n{{\n\t.reg .pred \t%p<4>;\n\t.reg .b32 \t%r<20>;\n"
            f"\t.reg .b64 \t%rd<20>;\n\n{loads}")


# A grid-stride loop over in -> out with a 128-bit path, a scalar tail and a rare patch block
# between the wide load and the wide store. The input address is carried around the back edge.
_KERNEL = _entry("k_f32") + """	cvta.to.global.u64 	%rd4, %rd1;
	cvta.to.global.u64 	%rd5, %rd2;
	mov.u64 	%rd6, 0;
$L__BB0_1:
	shl.b64 	%rd7, %rd6, 4;
	add.s64 	%rd8, %rd4, %rd7;
	add.s64 	%rd9, %rd5, %rd7;
	setp.lt.s64 	%p1, %rd6, %rd3;
	@%p1 bra 	$L__BB0_3;
	ld.global.nc.f32 	%r1, [%rd8];
	st.global.f32 	[%rd9], %r1;
	bra.uni 	$L__BB0_5;
$L__BB0_3:
	ld.global.nc.v4.u32 	{%r2, %r3, %r4, %r5}, [%rd8];
	setp.ne.s32 	%p2, %r2, 0;
	@%p2 bra 	$L__BB0_4;
	add.s32 	%r2, %r2, 1;
	add.s32 	%r2, %r2, 1;
	add.s32 	%r2, %r2, 1;
	add.s32 	%r2, %r2, 1;
$L__BB0_4:
	st.global.v4.u32 	[%rd9], {%r2, %r3, %r4, %r5};
$L__BB0_5:
	add.s64 	%rd6, %rd6, 1;
	setp.lt.s64 	%p3, %rd6, %rd3;
	@%p3 bra 	$L__BB0_1;
	ret;
}
"""

# The same stream read only element by element, and a value loaded from memory used as an address
# (a gather): the gathered access must not count as the index argument's stream.
_SCALAR = _entry("s_f32") + """	cvta.to.global.u64 	%rd4, %rd1;
	@%p1 ld.global.nc.u64 	%rd5, [%rd4];
	ld.global.nc.f32 	%r1, [%rd5];
	ld.local.u32 	%r2, [%rd6];
	cvta.to.global.u64 	%rd6, %rd2;
	st.global.f32 	[%rd6], %r1;
	ret;
}

.func helper(
	.param .u64 helper_param_0
)
{
	ret;
}
"""


def _manifest(symbol: str, dense_in: bool = True, kind: str = "elementwise") -> dict:
    return {"kernels": [{"name": symbol, "kind": kind, "chunk": 4, "symbols": {"f32": symbol},
                         "args": [{"role": "in", "layout": "dense" if dense_in else "gathered"},
                                  {"role": "out", "layout": "dense"}, {"role": "n"}]}]}


def test_streams_follow_addresses_through_the_loop():
    (entry,) = audit.parse(_KERNEL)
    assert entry.name == "k_f32" and entry.params == 3
    wide = [a for a in entry.accesses if a.bits == 128]
    assert {(a.kind, frozenset(a.params)) for a in wide} == {("ld", frozenset({0})), ("st", frozenset({1}))}
    scalar = [a for a in entry.accesses if a.bits == 32]
    assert {(a.kind, frozenset(a.params)) for a in scalar} == {("ld", frozenset({0})), ("st", frozenset({1}))}


def test_a_loaded_value_is_not_an_argument_address():
    # The index is loaded under a predicate; the .func after the entry is not part of it.
    (entry,) = audit.parse(_SCALAR)
    streams = [(a.kind, a.bits, frozenset(a.params)) for a in entry.accesses]
    assert streams == [("ld", 64, frozenset({0})), ("ld", 32, frozenset()), ("st", 32, frozenset({1}))]
    assert entry.instructions[-1] == "ret"


def test_a_predicated_return_falls_through():
    ptx = _KERNEL.replace("	bra.uni 	$L__BB0_5;", "	@%p2 ret;")
    (entry,) = audit.parse(ptx)
    assert audit.fast_path_instructions(entry, {0}, {1}) == 4
    succ = audit._successors(entry)
    returning = next(b for b, (_, m) in enumerate(entry.blocks) if m and entry.instructions[m[-1]] == "@%p2 ret")
    assert succ[returning] == [returning + 1]


def test_local_memory_fails_the_check_in_row_kernels_only():
    (elementwise,) = audit.audit_bundle(_manifest("s_f32", dense_in=False), _SCALAR, "s")
    (rows,) = audit.audit_bundle(_manifest("s_f32", dense_in=False, kind="rows"), _SCALAR, "s")
    assert elementwise.local == rows.local == 1 and rows.rows and not elementwise.rows


def test_dense_streams_with_and_without_128_bit_accesses():
    (good,) = audit.audit_bundle(_manifest("k_f32"), _KERNEL, "k")
    assert good.dense == [(0, "in"), (1, "out")] and good.missing == []
    (bad,) = audit.audit_bundle(_manifest("s_f32"), _SCALAR, "s")
    assert bad.missing == [(0, "in"), (1, "out")]
    # An argument that is not dense is not held to 128 bits.
    (gathered,) = audit.audit_bundle(_manifest("s_f32", dense_in=False), _SCALAR, "s")
    assert gathered.missing == [(1, "out")]


def test_fast_path_skips_the_rare_block():
    (entry,) = audit.parse(_KERNEL)
    # Wide-load block (3 instructions: load, compare, branch) straight to the wide-store block (1):
    # the four-instruction patch between them is the expensive way round.
    assert audit.fast_path_instructions(entry, {0}, {1}) == 4
    (report,) = audit.audit_bundle(_manifest("k_f32"), _KERNEL, "k")
    assert report.fast == 4 and report.total == len(entry.instructions)
    assert "| k | k_f32 | f32 | 2 | all |" in audit.table([report]) and report.local == 0


def test_missing_symbol_and_check_exit(tmp_path: Path):
    with pytest.raises(SystemExit, match="not in the PTX"):
        audit.audit_bundle(_manifest("absent"), _KERNEL, "k")
    (tmp_path / "s.json").write_text(json.dumps(_manifest("s_f32")))
    (tmp_path / "s.ptx").write_text(_SCALAR)
    assert audit.main([str(tmp_path), "--ptx-dir", str(tmp_path), "--table", str(tmp_path / "t.md")]) == 0
    assert audit.main([str(tmp_path), "--ptx-dir", str(tmp_path), "--check", "--table", str(tmp_path / "t.md")]) == 1
    assert "missing arg0 (in), arg1 (out)" in (tmp_path / "t.md").read_text()
    # Local memory alone fails a row kernel, not an elementwise one.
    (tmp_path / "s.json").write_text(json.dumps(_manifest("s_f32", dense_in=False, kind="rows")))
    (tmp_path / "s.ptx").write_text(_SCALAR.replace("st.global.f32", "st.global.v4.f32"))
    assert audit.main([str(tmp_path), "--ptx-dir", str(tmp_path), "--check", "--table", str(tmp_path / "t.md")]) == 1
    (tmp_path / "s.json").write_text(json.dumps(_manifest("s_f32", dense_in=False)))
    assert audit.main([str(tmp_path), "--ptx-dir", str(tmp_path), "--check", "--table", str(tmp_path / "t.md")]) == 0
    with pytest.raises(SystemExit, match="no kernel bundles"):
        audit.main([str(tmp_path / "t.md"), "--ptx-dir", str(tmp_path)])
