"""abp.author: operators written as traced Python functions (docs/python.md).

Each operator is traced into abp IR, compiled at run time and run; forward must equal the
maths, backward the derivative the function defines, and what is saved the residuals the
backward closure uses (a mask at 1 bit, codes at b bits, a parameter as a scalar, a float tensor
whole). Mistakes are AbpErrors that name the user's file and line.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

import abp
from abp import _custom_ops
from abp.author import (AuthoringError, dequantize, exp, log1p, operator, quantize, tanh, where)
from abp.buckets import fit_buckets
from abp_reference import compiler_or_skip

_names = itertools.count()


def fresh(stem: str) -> str:
    return f"test_author_{stem}_{next(_names)}"


@pytest.fixture(autouse=True)
def _compiler() -> None:
    compiler_or_skip()


def test_a_parameter_and_a_mask_saved_with_one_bit() -> None:
    @operator(name=fresh("leaky"), params=("slope",))
    def leaky(x, slope):
        positive = x > 0
        y = where(positive, x, x * slope)

        def backward(dy):
            return where(positive, dy, dy * slope)
        return y, backward

    torch.manual_seed(0)
    x = torch.randn(3001, requires_grad=True)
    dy = torch.randn(3001)
    y = leaky(x, 0.125)
    assert torch.equal(y, torch.where(x > 0, x, x * 0.125))
    y.backward(dy)
    assert torch.equal(x.grad, torch.where(x > 0, dy, dy * 0.125))
    assert leaky.saved_bits == 1
    assert sorted(r["kind"] for r in leaky.manifest["residuals"]) == ["codes", "scalar"]
    assert leaky.manifest["params"] == ["slope"]
    assert f"abp_{leaky.name}_bwd" in leaky.cuda


def mish_derivative(v: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(torch.nn.functional.softplus(v))
    return t + v * torch.sigmoid(v) * (1 - t * t)


def test_a_fitted_table_gives_a_two_bit_mish() -> None:
    table = fit_buckets(mish_derivative, 2)

    @operator(name=fresh("mish"))
    def mish(x):
        codes = quantize(x, table)

        def backward(dy):
            return dequantize(codes) * dy
        return x * tanh(log1p(exp(x))), backward

    torch.manual_seed(1)
    x = (torch.randn(2049) * 3).requires_grad_(True)
    dy = torch.randn(2049)
    y = mish(x)
    torch.testing.assert_close(y, torch.nn.functional.mish(x), rtol=2e-6, atol=2e-6)
    y.backward(dy)
    assert torch.equal(x.grad, table(x.detach()) * dy)
    assert mish.saved_bits == 2


def test_equality_is_elementwise_and_nan_is_unequal() -> None:
    @operator(name=fresh("eq"))
    def zero_to_one(x):
        at_zero, other = x == 0.0, x != 0.0
        return where(at_zero, 1.0, x) + where(other, 0.0, 1.0), lambda dy: dy

    x = torch.tensor([0.0, -0.0, 2.0, float("nan")])
    torch.testing.assert_close(zero_to_one(x), torch.tensor([2.0, 2.0, 2.0, float("nan")]),
                               equal_nan=True)


def test_two_inputs_save_what_backward_reads() -> None:
    @operator(name=fresh("mul"))
    def mul(a, b):
        def backward(g):
            return g * b, g * a
        return a * b, backward

    a = torch.randn(500, requires_grad=True)
    b = torch.randn(500, requires_grad=True)
    g = torch.randn(500)
    mul(a, b).backward(g)
    assert torch.equal(a.grad, g * b.detach()) and torch.equal(b.grad, g * a.detach())
    assert mul.saved_bits == 64  # both inputs, whole


def test_the_ir_carries_the_python_lines_that_traced_it() -> None:
    @operator(name=fresh("double"))
    def double(x):
        return x * 2.0, lambda dy: dy * 2.0  # this line traces both directions

    assert f'loc("{__file__}":' in double.ir
    assert double.saved_bits == 0


def _authoring_error_at_this_file(build) -> str:
    with pytest.raises(AuthoringError) as info:
        build()
    assert f"{__file__}:" in str(info.value)
    return str(info.value)


def test_mistakes_name_the_line_and_say_what_to_do() -> None:
    def branch():
        @operator(name=fresh("branch"))
        def f(x):
            if x > 0:
                return x, lambda dy: dy
            return -x, lambda dy: -dy

    assert "use abp.author.where" in _authoring_error_at_this_file(branch)

    def mask_arithmetic():
        @operator(name=fresh("mask"))
        def f(x):
            return (x > 0) * x, lambda dy: dy

    assert "a mask (a comparison) selects" in _authoring_error_at_this_file(mask_arithmetic)

    def codes_arithmetic():
        @operator(name=fresh("codes"))
        def f(x):
            return quantize(x, ([0.0], [0.0, 1.0])) * 2.0, lambda dy: dy

    assert "read by dequantize" in _authoring_error_at_this_file(codes_arithmetic)

    def gradient_count():
        @operator(name=fresh("grads"))
        def f(a, b):
            return a * b, lambda g: g

    assert "backward returns 1 gradient(s) for 2 tensor input(s)" in \
        _authoring_error_at_this_file(gradient_count)

    def bad_table():
        @operator(name=fresh("table"))
        def f(x):
            codes = quantize(x, ([0.5, 0.5, 1.0], [0.0, 0.1, 0.2, 0.3]))
            return x, lambda dy: dequantize(codes) * dy

    assert "increase strictly in fp32" in _authoring_error_at_this_file(bad_table)


def test_a_library_name_is_refused_and_a_redefinition_gets_its_own_name() -> None:
    message = _authoring_error_at_this_file(lambda: operator(lambda x: (x, lambda dy: dy),
                                                             name="gelu_b2"))
    assert "'gelu_b2' is taken by the op library" in message
    stem = fresh("variant")
    variants = []
    for scale in (2.0, 3.0, 2.0):  # a loop over variants, or an edited notebook cell
        @operator(name=stem)
        def scaled(x):
            return x * scale, lambda dy: dy * scale
        variants.append(scaled)
    assert variants[0].name == stem == variants[2].name  # the same maths: the same operator
    assert variants[1].name.startswith(stem + "_") and variants[1].name != stem
    x = torch.ones(3)
    assert torch.equal(variants[1](x), x * 3.0) and torch.equal(variants[2](x), x * 2.0)


def test_the_same_maths_on_other_lines_is_the_same_operator() -> None:
    """Source locations only point diagnostics: a cell run again after lines above it changed
    keeps its operator (and its name), with no new compile."""
    stem = fresh("moved")

    def first(x):
        return x * 2.0, lambda dy: dy * 2.0

    def second(x):  # the same maths, defined lines later

        return x * 2.0, lambda dy: dy * 2.0
    a, b = operator(first, name=stem), operator(second, name=stem)
    assert a.name == b.name == stem and b.ir == a.ir


def test_parameters_are_named_checked_and_take_keywords_and_defaults() -> None:
    def leaky(x, slope=0.01):
        return where(x > 0, x, x * slope), lambda dy: where(x > 0, dy, dy * slope)

    op = operator(leaky, name=fresh("leaky_defaults"), params=("slope",))
    x = torch.tensor([-2.0, 3.0])
    want = torch.tensor([-0.2, 3.0])
    torch.testing.assert_close(op(x, 0.1), want)
    torch.testing.assert_close(op(x, slope=0.1), want)
    torch.testing.assert_close(op(x=x, slope=0.1), want)
    torch.testing.assert_close(op.module(slope=0.1)(x), want)
    torch.testing.assert_close(op(x), torch.tensor([-0.02, 3.0]))  # the default
    torch.testing.assert_close(op.module()(x), torch.tensor([-0.02, 3.0]))
    with pytest.raises(TypeError, match="unexpected keyword argument 'alpha'; its arguments are \\['x', 'slope'\\]"):
        op(x, alpha=0.1)
    with pytest.raises(TypeError, match="got 'slope' both by position and by keyword"):
        op(x, 0.1, slope=0.2)
    # params= naming other arguments than the function's last ones: refused at definition.
    for params, wrong in ((("alpha",), "leaky"), (("x",), "leaky")):
        with pytest.raises(AuthoringError, match="params= names .* but its last 1 argument\\(s\\) are"):
            operator(leaky, name=fresh(wrong), params=params)

    def slope_first(slope, x):
        return x * slope, lambda dy: dy * slope
    with pytest.raises(AuthoringError, match="the parameters come after the tensor inputs"):
        operator(slope_first, name=fresh("slope_first"), params=("slope",))


def test_a_returned_gradient_that_is_no_tensor_is_named() -> None:
    def constant(x):
        return x * 2.0, lambda dy: 2.0

    def none_for_y(x, y):
        return x * y, lambda dy: (dy * y, None)
    cases = ((constant, "gradient 0 \\(for x\\) must be a traced float tensor of the backward, got the number 2.0"),
             (none_for_y, "gradient 1 \\(for y\\) .* got None \\(an input without a gradient is named in no_grad=\\)"))
    for fn, match in cases:
        with pytest.raises(AuthoringError, match=match):
            operator(fn, name=fresh(fn.__name__))
    with pytest.raises(AuthoringError, match="name: 'my-op' is not an identifier"):
        operator(constant, name="my-op")
    with pytest.raises(AuthoringError, match="a lambda needs name="):
        operator(lambda x: (x, lambda dy: dy))


def test_a_backward_that_never_reads_its_gradient_is_warned_about() -> None:
    table = ([0.0], [0.5, 1.0])

    def forgot_dy(x):
        codes = quantize(x, table)
        return tanh(x), lambda dy: dequantize(codes)  # "* dy" forgotten

    with pytest.warns(UserWarning, match="backward never reads the gradient of output 0"):
        operator(forgot_dy, name=fresh("forgot_dy"))


def test_arithmetic_on_parameters_and_python_builtins() -> None:
    @operator(name=fresh("squareplus"), params=("b",))
    def squareplus(x, b):
        quarter = b / 4  # parameters alone: computed inside the maps that use them
        y = (x + (x ** 2 + 4 * quarter) ** 0.5) / 2

        def backward(dy):
            return dy * (1 + x / (x * x + b) ** 0.5) / 2
        return y, backward

    x = torch.randn(1000, requires_grad=True)
    y = squareplus(x, 1.5)
    torch.testing.assert_close(y, (x + torch.sqrt(x * x + 1.5)) / 2, rtol=1e-6, atol=1e-6)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (1 + x / torch.sqrt(x * x + 1.5)).detach() / 2,
                               rtol=1e-6, atol=1e-6)

    @operator(name=fresh("builtins"))
    def builtins(x):
        return abs(x) + 2 ** x + x % 0.75 + x // 2, lambda dy: dy

    x = torch.randn(100)
    expected = x.abs() + 2 ** x + torch.remainder(x, 0.75) + torch.floor_divide(x, 2)
    torch.testing.assert_close(builtins(x), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="parameter 'b' must be a number, got str"):
        squareplus(x, "a")


def test_remainder_and_floor_division_are_torchs_not_cs_fmod() -> None:
    """`%` takes the divisor's sign, as torch.remainder (and Python, up to a zero's sign) do; it
    traced to C's fmod, which keeps the dividend's: -1 % 0.3 gave -0.1, not 0.2. `//` is
    torch.floor_divide's, so that (a // b) * b + a % b is a: floor(a / b) made 1.0 // 0.1 10."""
    @operator(name=fresh("mod_number"))
    def by_number(x):
        return x % 0.3, lambda dy: dy

    @operator(name=fresh("mod_negative"))
    def by_negative(x):
        return x % -0.3, lambda dy: dy

    @operator(name=fresh("mod_tensor"))
    def by_tensor(x, y):
        return x % y, lambda dy: (dy, dy)

    @operator(name=fresh("mod_reversed"))
    def reversed_(x):
        return 2.5 % x, lambda dy: dy

    @operator(name=fresh("mod_param"), params=("m",))
    def by_param(x, m):
        return x % m, lambda dy: dy

    inf, nan = float("inf"), float("nan")
    x = torch.tensor([1.0, -1.0, 0.7, -0.7, 0.0, -0.0, 5.0, -5.0, nan, 1e-30, -0.6, 3.0])
    y = torch.tensor([0.3, 0.3, -0.3, -0.3, 2.0, -2.0, inf, inf, 1.0, -1e-20, 0.3, -inf])
    exact = lambda got, want: torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # noqa: E731
    assert by_number(x)[1].item() == pytest.approx(0.2)  # not fmod's -0.1
    exact(by_number(x), torch.remainder(x, 0.3))
    exact(by_negative(x), torch.remainder(x, -0.3))
    exact(by_tensor(x, y), torch.remainder(x, y))
    exact(reversed_(x), torch.remainder(torch.full_like(x, 2.5), x))
    for m in (0.3, -0.3, 2.0):
        exact(by_param(x, m), torch.remainder(x, m))
    finite = torch.randn(1000) * 10
    divisor = torch.randn(1000)
    exact(by_tensor(finite, divisor), torch.remainder(finite, divisor))

    @operator(name=fresh("floordiv_tensor"))
    def floor_divided(x, y):
        return x // y, lambda dy: (dy, dy)

    @operator(name=fresh("mod_params_alone"), params=("m", "n"))
    def params_alone(x, m, n):  # a deferred expression of parameters, computed in the map using it
        return x * (m % n) + (m // n) + (2.5 % m), lambda dy: dy

    zeros = torch.tensor([1.0, 2.0, 0.0, -0.0])
    over_zero = torch.tensor([0.0, -0.0, -3.0, 2.0])
    for a, b in ((x, y), (finite, divisor), (zeros, over_zero)):
        got, want = floor_divided(a, b), torch.floor_divide(a, b)
        assert torch.equal(got.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
        assert torch.equal(got.isnan(), want.isnan())
    assert floor_divided(torch.tensor([1.0]), torch.tensor([0.1])).item() == 9.0  # floor(1 / 0.1) is 10
    for m, n in ((2.5, -0.7), (-2.5, 0.7), (3.0, 1.5)):
        want = torch.remainder(torch.tensor(m), n) + torch.floor_divide(torch.tensor(m), n) + torch.remainder(
            torch.tensor(2.5), m)
        exact(params_alone(torch.ones(3), m, n), want.expand(3))


def test_a_constant_beyond_float32_names_the_line() -> None:
    """1e39 is finite in Python, infinite in the kernels' float32: a map constant became inf
    silently, a table level an error located in the generated IR (a line the user never sees)."""
    def constant():
        @operator(name=fresh("huge_constant"))
        def f(x):
            return x * 1e39, lambda dy: dy

    def level():
        @operator(name=fresh("huge_level"))
        def f(x):
            codes = quantize(x, ([0.0], [0.0, 1e39]))
            return x, lambda dy: dy * dequantize(codes)

    for build in (constant, level):
        assert "the constant 1e+39 is not finite in float32" in _authoring_error_at_this_file(build)


def test_more_mistakes_name_the_line() -> None:
    import math

    def foreign_function():
        @operator(name=fresh("atan"))
        def f(x):
            return math.atan(x), lambda dy: dy

    assert "use the functions of abp.author" in _authoring_error_at_this_file(foreign_function)

    def torch_function():
        @operator(name=fresh("torch_tanh"))
        def f(x):
            return torch.tanh(x), lambda dy: dy

    assert "tanh (torch) cannot run on a traced value" in _authoring_error_at_this_file(torch_function)

    def backward_arity():
        @operator(name=fresh("arity"))
        def f(x):
            return (x, x * 2.0), lambda dy: dy

    assert "backward must take one gradient per output (2)" in \
        _authoring_error_at_this_file(backward_arity)

    def forgotten_params():
        @operator(name=fresh("noparams"))
        def f(x, slope):
            return x * slope, lambda dy: dy * slope

    assert "name parameters in params=" in _authoring_error_at_this_file(forgotten_params)

    with pytest.raises(AuthoringError, match=r"params: expected a sequence of names, e.g. \('slope',\)"):
        operator(params="slope")


@pytest.mark.skipif(not _custom_ops.supported_torch(), reason="torch.library needs torch >= 2.4")
def test_it_compiles_without_graph_breaks() -> None:
    @operator(name=fresh("square"))
    def square(x):
        def backward(dy):
            return 2.0 * x * dy
        return x * x, backward

    x = torch.randn(64, requires_grad=True)
    compiled = torch.compile(lambda t: square(t).sum(), backend="aot_eager", fullgraph=True)
    compiled(x).backward()
    assert torch.equal(x.grad, 2.0 * x.detach())

    # Two inputs and a float parameter: a torch.library op too.
    @operator(name=fresh("scaled_product"), params=("k",))
    def scaled_product(a, b, k):
        return a * b * k, lambda dy: (dy * b * k, dy * a * k)

    a, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    compiled = torch.compile(lambda p, q: scaled_product(p, q, 3.0).sum(), backend="aot_eager", fullgraph=True)
    compiled(a, b).backward()
    assert torch.equal(a.grad, 3.0 * b.detach()) and torch.equal(b.grad, 3.0 * a.detach())


def _kernel_text(source: str, name: str) -> str:
    """Generated source without its first line (which names the file it came from), with the
    operator's name and the kernels' content hashes (which hash the name too) masked."""
    import re

    body = source.split("\n", 1)[1]
    return re.sub(r"_[0-9a-f]{8}(?=\b|__)", "_HASH", body).replace(name, "OP")


def test_regelu2_written_in_python_matches_the_library_operator_bit_for_bit() -> None:
    # The library's table, read from ops/lowmembp/regelu2.mlir itself (fp64 text, as there).
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "ops/lowmembp/regelu2.mlir").read_text()
    borders, levels = (
        [float(v) for v in re.search(rf"{key} = \[([^\]]*)\]", text).group(1).split(",")]
        for key in ("borders", "levels"))
    from abp.author import erf

    @operator(name=fresh("regelu2"))
    def regelu2(x):
        # The library's operations in the library's order (its @activation, then the codes).
        p = erf(x * 0.707106781186547524) + 1.0
        y = x * 0.5 * p
        codes = quantize(x, (borders, levels))
        return y, lambda dy: dequantize(codes) * dy

    # The same kernels, character for character, up to the operator's name: the library's map
    # over a func.func and the front end's maps fuse into one kernel body alike.
    assert _kernel_text(regelu2.cuda, regelu2.name) == _kernel_text(
        abp.inspect("regelu2")["source"], "regelu2")

    torch.manual_seed(2)
    x = torch.randn(10007) * 3
    x[:5] = torch.tensor([float(borders[0]), float(borders[1]), float(borders[2]), 0.0, -0.0])
    dy = torch.randn(10007)
    mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_mine, y_theirs = regelu2(mine), abp.functional.regelu2(theirs)
    assert torch.equal(y_mine, y_theirs)
    y_mine.backward(dy)
    y_theirs.backward(dy)
    assert torch.equal(mine.grad, theirs.grad)
    assert regelu2.saved_bits == abp.inspect("regelu2")["operator"]["saved_bits_per_element"] == 2


def test_ms_layernorm_written_in_python_matches_the_library_operator_bit_for_bit() -> None:
    from abp.author import mean_rows, sqrt

    @operator(name=fresh("msln"), params=("eps",), rows=True)
    def ms_layernorm(x, eps):
        xc = x - mean_rows(x)
        r = 1.0 / sqrt(mean_rows(xc * xc) + eps)  # per row
        y = xc * r

        def backward(g):  # uses the output y (shared: no copy) and r (one value per row)
            return r * ((g - mean_rows(g)) - y * mean_rows(g * y))
        return y, backward

    assert ms_layernorm.saved_bits == 0 and ms_layernorm.saved_bits_per_row == 32
    assert _kernel_text(ms_layernorm.cuda, ms_layernorm.name) == _kernel_text(
        abp.inspect("ms_layernorm")["source"], "ms_layernorm")
    torch.manual_seed(3)
    x = torch.randn(37, 300) * 2 + 0.5
    g = torch.randn(37, 300)
    mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_mine = ms_layernorm(mine, 1e-5)
    y_theirs = abp.functional.apply("ms_layernorm", theirs, (1e-5,))
    assert torch.equal(y_mine, y_theirs)
    y_mine.backward(g)
    y_theirs.backward(g)
    assert torch.equal(mine.grad, theirs.grad)
    torch.testing.assert_close(y_mine, torch.nn.functional.layer_norm(x, (300,), eps=1e-5),
                               rtol=1e-5, atol=1e-5)


def test_a_row_reduction_outside_a_row_operator_is_named() -> None:
    from abp.author import sum_rows

    def build():
        @operator(name=fresh("flat_sum"))
        def f(x):
            return x * sum_rows(x), lambda dy: dy

    assert "expected a matrix of a row operator" in _authoring_error_at_this_file(build)


def test_an_operator_as_a_module_in_a_model() -> None:
    @operator(name=fresh("scaled_tanh"), params=("scale",))
    def scaled_tanh(x, scale):
        y = tanh(x) * scale

        def backward(dy):  # uses the output: shared, 0 bits
            return (scale - y * y / scale) * dy
        return y, backward

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), scaled_tanh.module(1.5), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Identity(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())  # the module adds no state
    x = torch.randn(16, 8)
    model(x).sum().backward()
    reference[0].register_forward_hook(lambda m, i, o: torch.tanh(o) * 1.5)
    reference(x).sum().backward()
    assert scaled_tanh.saved_bits == 0
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    assert "scale=1.5" in repr(model[1])
    with pytest.raises(TypeError, match=r"missing \['scale'\]; it takes 1 tensor\(s\) \['x'\] and the parameters \['scale'\]"):
        scaled_tanh.module()


def test_draws_per_row_inputs_without_gradient_and_per_row_outputs() -> None:
    # Dropout scaled per row: x kept where its draw is below 0.5 and times its row's scale s
    # (an input without a gradient); also the kept sum of each row (a per-row output).
    import numpy as np

    import gact_reference as ref
    from abp.author import sum_rows, uniform

    @operator(name=fresh("row_dropout"), params={"seed": int, "offset": int}, rows=True,
              per_row=("s",), no_grad=("s",))
    def row_dropout(x, s, seed, offset):
        keep = uniform(seed, offset) < 0.5
        y = where(keep, x * s, 0.0)
        def backward(dy, dr):
            return where(keep, (dy + dr) * s, 0.0)
        return (y, sum_rows(y)), backward

    assert "no_grad = array<i64: 1>" in row_dropout.ir and "abp.uniform %p0, %p1 : i64, i64" in row_dropout.ir
    assert row_dropout.saved_bits == 1 and row_dropout.saved_bits_per_row == 32  # the mask; s
    seed, offset = (1 << 40) + 3, 7
    x = torch.randn(6, 48, requires_grad=True)
    s = torch.rand(6) + 0.5
    y, r = row_dropout(x, s, seed, offset)
    keep = torch.from_numpy(ref.uniform_at(seed, np.arange(x.numel(), dtype=np.uint64) + np.uint64(offset)) < 0.5)
    expected = torch.where(keep.reshape(x.shape), x.detach() * s[:, None], torch.zeros(()))
    assert torch.equal(y, expected) and r.shape == (6,)
    torch.testing.assert_close(r, expected.sum(-1))
    gy, gr = torch.randn(x.shape), torch.randn(6)
    torch.autograd.backward([y, r], [gy, gr])
    assert torch.equal(x.grad, torch.where(keep.reshape(x.shape), (gy + gr[:, None]) * s[:, None], torch.zeros(())))
    with pytest.raises(TypeError, match="parameter 'seed' must be an int, got float"):
        row_dropout(x, s, 1.5, 0)
    with pytest.raises(ValueError, match=r"parameter 'offset' must lie in \[0, 2\*\*63\), got -1"):
        row_dropout(x, s, 1, -1)
    # Seeds from numpy or torch are integers too: the same draws as the Python int.
    again, _ = row_dropout(x, s, np.int64(seed), torch.tensor(offset))
    assert torch.equal(again, y)
    # Arguments are named as the user named them.
    with pytest.raises(ValueError, match=r"row_dropout_\d+: s: expected one value per row of x: a tensor of shape \(6,\), "
                                         r"dtype torch.float32, on cpu, got shape \(5,\)"):
        row_dropout(x, s[:5], seed, offset)


@pytest.mark.skipif(not _custom_ops.supported_torch(), reason="torch.library needs torch >= 2.4")
def test_draws_per_row_values_and_no_grad_inputs_compile_without_graph_breaks_or_a_compile_per_seed() -> None:
    from abp.author import sum_rows, uniform

    @operator(name=fresh("compiled_row_dropout"), params={"seed": int, "offset": int, "p": float},
              rows=True, per_row=("s",), no_grad=("s",))
    def row_dropout(x, s, seed, offset, p):
        keep = uniform(seed, offset) >= p
        y = where(keep, x * s, 0.0)
        return (y, sum_rows(y)), lambda dy, dr: where(keep, (dy + dr) * s, 0.0)

    graphs = []

    def counting(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def step(x, s, seed):
        y, r = row_dropout(x, s, seed, 3, 0.25)
        return (y * y).sum() + r.sum()

    compiled = torch.compile(step, backend=counting, fullgraph=True)
    x, s = torch.randn(5, 40), torch.rand(5) + 0.5
    for seed in range(10, 14):  # a new seed every step, as training makes them
        mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        compiled(mine, s, seed).backward()
        step(theirs, s, seed).backward()
        assert torch.equal(mine.grad, theirs.grad)
    # The first seed specialises, the second makes it symbolic; no further compiles.
    assert len(graphs) <= 2
    calls = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert getattr(torch.ops.abp, f"{row_dropout.name}_fwd").default in calls
    # Schema (SymInt seeds), fake tensors (per-row output, per-row residual), autograd (no
    # gradient for s) and dynamic shapes, as torch.library checks them.
    plan = _custom_ops.plan(row_dropout.name)
    assert "SymInt param0, SymInt param1, float param2" in str(plan.fwd._schema)
    torch.library.opcheck(plan.fwd, (x.clone().requires_grad_(True), s, 12, 3, 0.25))


def test_sample_and_unsample_read_rows_by_index() -> None:
    # Forward keeps weight[r] * x[index[r]] (k rows of an N-row x); backward puts each kept row's
    # gradient back where slot says: the defined derivative, as ops/sample's sample_rows codec.
    from abp.author import sample, unsample

    @operator(name=fresh("gather"), rows=True, index=("index", "slot"), per_row=("weight",),
              no_grad=("weight",))
    def gather(x, index, weight, slot):
        kept = sample(x, index, weight)
        return kept, lambda g: unsample(g, slot)

    assert "abp.sample %x0, %x1, %x2" in gather.ir and "abp.unsample %g0, %r0" in gather.ir
    assert "no_grad = array<i64: 2, 1, 3>" in gather.ir and "tensor<?xi32>" in gather.ir
    # The same kernels as the operator written in IR by hand.
    name = fresh("gather_ir")
    ir = f"""
abp.operator @{name} attributes {{no_grad = array<i64: 1, 2, 3>}} forward {{
^bb0(%x: tensor<?x?xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>, %slot: tensor<?xi32>):
  %kept = abp.sample %x, %index, %weight : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return %kept : tensor<?x?xf32> saves %slot : tensor<?xi32>
}} backward {{
^bb0(%slot: tensor<?xi32>, %g: tensor<?x?xf32>):
  %dx = abp.unsample %g, %slot : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
  abp.return %dx : tensor<?x?xf32>
}}
"""
    abp.compile_operators(ir, origin="test_author.py")
    assert _kernel_text(gather.cuda, gather.name) == _kernel_text(abp.inspect(name)["source"], name)

    torch.manual_seed(7)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(2, 3, 5, dtype=dtype, requires_grad=True)  # 6 rows
        index = torch.tensor([5, -1, 0, 3], dtype=torch.int32)
        weight = torch.tensor([2.0, 1.0, -0.5, 3.0], dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        slot = torch.tensor([[2, -1, -1], [3, -1, 0]], dtype=torch.int32)  # one per row of x
        kept = gather(x, index, weight, slot)
        rows = x.detach().reshape(6, 5)
        want = torch.stack([w * rows[i] if i >= 0 else torch.zeros(5, dtype=dtype)
                            for i, w in zip(index.tolist(), weight.to(dtype).tolist())])
        assert kept.shape == (4, 5) and torch.equal(kept, want)
        g = torch.randn(4, 5, dtype=dtype)
        kept.backward(g)
        back = torch.stack([g[t] if t >= 0 else torch.zeros(5, dtype=dtype) for t in slot.flatten().tolist()])
        assert torch.equal(x.grad, back.reshape(2, 3, 5))

    # The user's arguments are named: index and weight have the sample's rows, slot x's.
    x = torch.randn(6, 5)
    index, weight, slot = torch.tensor([1, 2], dtype=torch.int32), torch.ones(2), torch.zeros(6, dtype=torch.int32)
    with pytest.raises(ValueError, match=r": weight: expected one value per row of the sample's rows \(index\): "
                                         r"a tensor of shape \(2,\), dtype torch.float32, on cpu, got shape \(3,\)"):
        gather(x, index, torch.ones(3), slot)
    with pytest.raises(ValueError, match=r": slot: expected one value per row of x: a tensor of shape \(6,\), "
                                         r"dtype torch.int32, on cpu, got shape \(2,\)"):
        gather(x, index, weight, slot[:2])
    with pytest.raises(ValueError, match=r": index: expected .* dtype torch.int32, on cpu, got shape \(2,\), dtype torch.int64"):
        gather(x, index.long(), weight, slot)
    with pytest.raises(ValueError, match=r"input1 holds row indices of input0, which must lie in \[-1, 6\), got \[1, 6\]"):
        gather(x, torch.tensor([1, 6], dtype=torch.int32), weight, slot)


def test_mistakes_with_sample_and_unsample_are_named() -> None:
    from abp.author import sample, unsample

    def arithmetic_on_indices():
        @operator(name=fresh("index_math"), rows=True, index=("index",))
        def f(x, index):
            return x * index, lambda g: g

    assert "row indices (an index= input) are read by sample and unsample" in _authoring_error_at_this_file(
        arithmetic_on_indices)

    def swapped():
        @operator(name=fresh("swapped"), rows=True, index=("index",), per_row=("w",), no_grad=("w",))
        def f(x, index, w):
            return sample(x, w, index), lambda g: g

    assert "sample: index must be an input named in index=" in _authoring_error_at_this_file(swapped)

    def unsample_by_weights():
        @operator(name=fresh("by_weights"), rows=True, per_row=("w",), no_grad=("w",))
        def f(x, w):
            return x * w, lambda g: unsample(g, w)

    assert "unsample: slot must be an input named in index=" in _authoring_error_at_this_file(unsample_by_weights)
    with pytest.raises(AuthoringError, match="index inputs need a row operator"):
        operator(lambda x, i: (x, lambda g: g), name=fresh("flat_index"), index=("i",))
    with pytest.raises(AuthoringError, match=r"\['i'\] named in both per_row and index"):
        operator(lambda x, i: (x, lambda g: g), name=fresh("both"), rows=True, index=("i",), per_row=("i",))


def test_mistakes_with_draws_per_row_inputs_and_no_grad_are_named() -> None:
    from abp.author import uniform

    def seed_in_arithmetic():
        @operator(name=fresh("seed_math"), params={"seed": int})
        def f(x, seed):
            return x * seed, lambda dy: dy

    assert "an integer parameter only keys draws" in _authoring_error_at_this_file(seed_in_arithmetic)

    def seed_in_backward():
        @operator(name=fresh("seed_bwd"), params={"seed": int, "offset": int})
        def f(x, seed, offset):
            u = uniform(seed, offset)
            return x + u, lambda dy: dy * uniform(seed, offset)

    assert "draws are made in forward" in _authoring_error_at_this_file(seed_in_backward)

    def float_seed():
        @operator(name=fresh("float_seed"), params=("seed", "offset"))
        def f(x, seed, offset):
            return x + uniform(seed, offset), lambda dy: dy

    assert "uniform: seed must be an integer parameter" in _authoring_error_at_this_file(float_seed)

    def gradient_for_a_no_grad_input():
        @operator(name=fresh("nograd_count"), no_grad=("w",))
        def f(x, w):
            return x * w, lambda dy: (dy * w, dy * x)

    assert "backward returns 2 gradient(s) for 2 tensor input(s), 1 of them in no_grad: expected 1, for ['x']" \
        in _authoring_error_at_this_file(gradient_for_a_no_grad_input)

    with pytest.raises(AuthoringError, match=r"no_grad names \['y'\], which are not among its tensor inputs \['x'\]"):
        operator(lambda x: (x, lambda dy: dy), name=fresh("unknown"), no_grad=("y",))
    with pytest.raises(AuthoringError, match="per_row inputs need a row operator"):
        operator(lambda x, s: (x * s, lambda dy: dy * s), name=fresh("norows"), per_row=("s",), no_grad=("s",))
    with pytest.raises(AuthoringError, match="the type of 'p' must be float or int"):
        operator(lambda x, p: (x, lambda dy: dy), name=fresh("badtype"), params={"p": str})

    def per_row_gradient_for_a_matrix():
        @operator(name=fresh("shape_grad"), rows=True, per_row=("s",))
        def f(x, s):
            return x * s, lambda dy: (dy * s, dy)  # ds must be per row: sum_rows(dy * x)

    assert "gradient 1 (for s) must be a traced float tensor of the backward (one value per row), got a matrix" \
        in _authoring_error_at_this_file(per_row_gradient_for_a_matrix)


def test_a_per_row_input_with_a_gradient() -> None:
    from abp.author import sum_rows

    @operator(name=fresh("row_scale"), rows=True, per_row=("s",))
    def row_scale(x, s):
        return x * s, lambda dy: (dy * s, sum_rows(dy * x))

    # A torch.library op too: its fake tensors give the per-row gradient its own shape.
    assert _custom_ops.registrable(abp._lib.kernel_library().operator(row_scale.name))
    x = torch.randn(5, 24, requires_grad=True)
    s = torch.randn(5, requires_grad=True)
    row_scale(x, s).backward(torch.ones(5, 24))
    torch.testing.assert_close(x.grad, s.detach()[:, None].expand(5, 24))
    torch.testing.assert_close(s.grad, x.detach().sum(-1))


def test_an_output_is_shared_only_when_backward_saves_nothing_else_per_element() -> None:
    from abp.author import sigmoid

    @operator(name=fresh("silu_from_y_and_x"))
    def silu(x):
        y = x * sigmoid(x)
        return y, lambda dy: dy * (y + sigmoid(x) * (1.0 - y))  # uses the output and the input

    @operator(name=fresh("silu_from_y"))
    def from_output(x):
        y = x * sigmoid(x)
        return y, lambda dy: dy * y  # the output alone: shared, no memory of its own

    assert "abp.share_saved" not in silu.ir and silu.saved_bits == 64  # y and x, whole
    assert "abp.share_saved" in from_output.ir and from_output.saved_bits == 0
    x = torch.randn(100, requires_grad=True)
    silu(x).backward(torch.ones(100))
    reference = x.detach().clone().requires_grad_(True)
    torch.nn.functional.silu(reference).backward(torch.ones(100))
    torch.testing.assert_close(x.grad, reference.grad)


def test_argument_errors_name_the_operator_and_the_argument() -> None:
    @operator(name=fresh("twice"))
    def twice(a, b):
        return a * b, lambda dy: (dy * b, dy * a)

    with pytest.raises(TypeError, match=r"twice_\d+: a: expected dtype torch.float32, torch.float16 or torch.bfloat16, got torch.float64"):
        twice(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"twice_\d+: b: expected the shape of a, \(3,\), got \(4,\)"):
        twice(torch.ones(3), torch.ones(4))


def test_every_output_is_a_tensor_of_its_own() -> None:
    """An operator returning one value twice gave two tensors sharing one buffer (writing one in
    place changed the other, and the gradient of the second came out wrong); one returning its
    input returned the input's own memory. Each output is now a copy the kernel writes."""
    @operator(name=fresh("twice"))
    def twice(x):
        y = x * 2.0
        return (y, y), lambda g1, g2: g1 * 2.0 + g2 * 2.0

    @operator(name=fresh("ident"))
    def ident(x):
        return x, lambda g: g

    x = torch.arange(4.0, requires_grad=True)
    a, b = twice(x)
    assert a.data_ptr() != b.data_ptr()
    with torch.no_grad():
        a.add_(100.0)
    assert torch.equal(b, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    (b * b).sum().backward()
    assert torch.equal(x.grad, 8 * torch.arange(4.0))
    h = torch.arange(4.0)
    y = ident(h)
    assert y.data_ptr() != h.data_ptr() and torch.equal(y, h)
    y.mul_(0.0)
    assert torch.equal(h, torch.arange(4.0))
    x = torch.arange(4.0, requires_grad=True)
    z = ident(x * 1.0)
    z.add_(10.0)  # an output of its own: autograd allows the in-place change
    z.sum().backward()
    assert torch.equal(x.grad, torch.ones(4))


def test_a_value_of_another_operators_trace_is_refused_where_it_is_used() -> None:
    # A value kept from another operator's definition (a global, a closure) used to be read by its
    # SSA name, which here names another value: exp(x) where tanh(x) was written, silently.
    kept = {}

    @operator(name=fresh("keeps"))
    def keeps(x):
        kept["t"] = tanh(x)
        return kept["t"], lambda dy: dy * (1 - kept["t"] * kept["t"])

    def in_backward():
        @operator(name=fresh("reads_b"))
        def f(x):
            return exp(x), lambda dy: dy * kept["t"]

    def in_forward():
        @operator(name=fresh("reads_f"))
        def f(x):
            return x * kept["t"], lambda dy: dy

    def through_a_function():
        @operator(name=fresh("reads_fn"))
        def f(x):
            return x * 1.0, lambda dy: dy * exp(kept["t"])

    def as_an_output():
        @operator(name=fresh("returns"))
        def f(x):
            return kept["t"], lambda dy: dy

    for mistake in (in_backward, in_forward, through_a_function):
        assert "another operator's definition" in _authoring_error_at_this_file(mistake)
    with pytest.raises(AuthoringError, match="another operator's trace"):
        as_an_output()
    x = torch.tensor([0.5, -1.0], requires_grad=True)
    keeps(x).sum().backward()  # the operator the value belongs to is unharmed
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach()) ** 2)


def test_python_idioms_on_traced_values_trace_or_say_what_to_use() -> None:
    @operator(name=fresh("rounding"))
    def rounding(x):
        return round(x) + math.floor(x) + 2 * math.ceil(x) + 4 * math.trunc(x), lambda dy: dy * 0

    x = torch.tensor([0.5, 1.5, -2.5, 2.7, -0.2, 3.0])
    want = [round(v) + math.floor(v) + 2 * math.ceil(v) + 4 * math.trunc(v) for v in x.tolist()]
    assert rounding(x).tolist() == want  # round: half to even, as Python's

    def method():
        @operator(name=fresh("method"))
        def f(x):
            return x.exp(), lambda dy: dy

    def shape():
        @operator(name=fresh("shape"))
        def f(x):
            return x * x.shape[0], lambda dy: dy

    def masks():
        @operator(name=fresh("masks"))
        def f(x):
            return where((x > 0) & (x < 1), x, 0.0 * x), lambda dy: dy

    def round_digits():
        @operator(name=fresh("digits"))
        def f(x):
            return round(x, 2), lambda dy: dy

    def keywords():
        @operator(name=fresh("kw"))
        def f(x, **options):
            return x, lambda dy: dy

    def constant_output():
        @operator(name=fresh("constant"))
        def f(x):
            return 3.0, lambda dy: dy

    assert "no attribute or method 'exp'" in _authoring_error_at_this_file(method)
    assert "no attribute or method 'shape'" in _authoring_error_at_this_file(shape)
    assert "nest where()" in _authoring_error_at_this_file(masks)
    assert "round(x * 10**n) / 10**n" in _authoring_error_at_this_file(round_digits)
    assert "takes **options" in _authoring_error_at_this_file(keywords)
    assert "x * 0 + 3.0" in _authoring_error_at_this_file(constant_output)

    @operator(name=fresh("probe"))
    def probe(x):
        assert not hasattr(x, "shape")  # an absent attribute, as hasattr expects
        return x * 2.0, lambda dy: dy * 2.0

    assert probe(x).tolist() == (x * 2).tolist()


def test_a_modules_parameters_by_name_and_as_numpy_or_torch_numbers() -> None:
    import numpy as np

    @operator(name=fresh("scaled"), params=("scale",))
    def scaled(x, scale):
        return x * scale, lambda dy: dy * scale

    x = torch.tensor([1.0, -2.0])
    for number in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), 0.5):
        assert scaled(x, number).tolist() == [0.5, -1.0]
    module = scaled.module(2.0)
    assert module.scale == 2.0
    module.scale = 3  # was a new attribute the module never read
    assert module(x).tolist() == [3.0, -6.0] and "scale=3.0" in repr(module)
    with pytest.raises(TypeError, match="parameter 'scale' must be a number, got str"):
        module.scale = "3"
    with pytest.raises(TypeError, match="parameter 'scale' must be a number, got Tensor"):
        scaled(x, torch.tensor(True))


def test_a_pickled_operator_runs_what_was_pickled_wherever_it_is_loaded(tmp_path) -> None:
    # Loaded where its name means other maths, a pickled module used to run those maths silently;
    # loaded where its name is unknown, it failed to find its operator.
    import pickle
    import subprocess
    import sys

    name = fresh("pickled")

    @operator(name=name, params=("slope",))
    def leaky(x, slope):
        positive = x > 0
        return where(positive, x, x * slope), lambda dy: where(positive, dy, dy * slope)

    path = tmp_path / "module.pkl"
    path.write_bytes(pickle.dumps(leaky.module(0.25)))
    same = pickle.loads(path.read_bytes())
    assert same.op.name == name and same(torch.tensor([-1.0, 2.0])).tolist() == [-0.25, 2.0]
    loader = f"""
import pickle, torch
from abp.author import operator
if {{other}}:
    @operator(name={name!r}, params=("slope",))
    def other(x, slope):
        return x * slope, lambda dy: dy * slope
    assert other.name == {name!r}
module = pickle.loads(open({str(path)!r}, "rb").read())
print(module.op.name, module(torch.tensor([-1.0, 2.0])).tolist())
"""
    for other in (True, False):
        run = subprocess.run([sys.executable, "-c", loader.replace("{other}", str(other))],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        loaded_name, values = run.stdout.split(" ", 1)
        assert values.strip() == "[-0.25, 2.0]"
        assert (loaded_name != name) == other  # another operator holds the name: the maths' own name
