// GELU, tanh form (torch's approximate="tanh", GPT-2's gelu_new) with FewBit k-bit derivatives: the
// forward is exact, the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in
// k bits per element; the tables are the global optima of tools/fewbit_solver.py for this
// activation's derivative (docs/python.md#gelu-tanh-form). The template below is the 3-bit
// standard-normal-weighted table; `abp-instantiate-variants` makes @gelu_tanh_b1..b4 (N(0,1)
// weight, the default) and @gelu_tanh_b1_uniform..b4_uniform (uniform weight on [-100, 100]).
// BEGIN GENERATED TABLES
// regenerate: /usr/bin/python3 tools/fewbit_solver.py --write-ops
#gelu_tanh_n1 = #abp.buckets<borders = [0.0], levels = [0.09089138040783941, 0.9091086195921615]>
#gelu_tanh_n2 = #abp.buckets<borders = [-0.49919428713455366, -3.8878976964996703e-16, 0.49919428713455305], levels = [-0.046378817125265655, 0.3126312828084561, 0.6873687171915435, 1.0463788171252675]>
#gelu_tanh_n3 = #abp.buckets<borders = [-0.7804556438385684, -0.46965613782700333, -0.22416200384428048, 3.131077060381591e-15, 0.22416200384428597, 0.4696561378270074, 0.7804556438385711], levels = [-0.09014971391059992, 0.06666021401297259, 0.2365547992840975, 0.4116868157264523, 0.5883131842735524, 0.7634452007159058, 0.933339785987029, 1.0901497139106024]>
#gelu_tanh_n4 = #abp.buckets<borders = [-2.0546295745940615, -0.9651922295862836, -0.7423000028878353, -0.5742862678520457, -0.4314364175789191, -0.3025305170903884, -0.18170951790555784, -0.06522047870775319, 0.04979736303265227, 0.16593469294006, 0.28598625551762963, 0.41353545159551813, 0.5540435778037666, 0.7176477852304415, 0.9296822248614287], levels = [-0.049007120816255606, -0.11141067413808546, -0.03677913813276309, 0.04560608006337932, 0.1319588678458216, 0.2207207119697554, 0.31100608298449944, 0.4022105577986214, 0.4938607731329164, 0.5855383482443491, 0.6768281110352946, 0.7672676235613062, 0.8562762428596296, 0.9430202224256546, 1.0260745244708291, 1.1021775557466504]>
#gelu_tanh_u1 = #abp.buckets<borders = [0.0], levels = [5.811323644522026e-19, 1.0]>
#gelu_tanh_u2 = #abp.buckets<borders = [-0.4537843421263037, -2.0673014969634158e-14, 0.45378434212627816], levels = [-0.0014816068630778441, 0.3250186104285744, 0.6749813895714003, 1.0014816068630779]>
#gelu_tanh_u3 = #abp.buckets<borders = [-2.419975926783881, -0.7112272402959048, -0.326270167015925, 5.711280543001011e-14, 0.3262701670160267, 0.7112272402959829, 2.4199759267837764], levels = [-0.00018829424736507123, -0.088539676446033, 0.12534895450750075, 0.3721205878689187, 0.6278794121311645, 0.8746510454925536, 1.0885396764460404, 1.000188294247365]>
#gelu_tanh_u4 = #abp.buckets<borders = [-2.70212275309497, -2.0642172731973947, -0.933228958812326, -0.6841656287176517, -0.4878713926746269, -0.31544603794060705, -0.1551051771595469, 1.2322503977396538e-12, 0.15510517716188124, 0.31544603794254716, 0.48787139267636315, 0.684165628719211, 0.9332289588131585, 2.0642172731973245, 2.702122753094978], levels = [-9.080730985422851e-05, -0.049004555951003705, -0.10935213633328307, -0.020975948693122796, 0.08336493795735292, 0.19692252014241607, 0.3161012669926603, 0.4383704080655151, 0.5616295919363842, 0.6838987330089509, 0.8030774798588262, 0.9166350620435639, 1.0209759486935972, 1.109352136333317, 1.0490045559510066, 1.0000908073098542]>
// END GENERATED TABLES

// GELU, tanh form: x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), in torch's order of
// operations.
func.func private @activation(%x: f32) -> f32 {
  %half = arith.constant 0.5 : f32
  %one = arith.constant 1.0 : f32
  %beta = arith.constant 0.7978845608028654 : f32
  %kappa = arith.constant 0.044715 : f32
  %x2 = arith.mulf %x, %x : f32
  %x3 = arith.mulf %x2, %x : f32
  %k = arith.mulf %kappa, %x3 : f32
  %s = arith.addf %x, %k : f32
  %u = arith.mulf %beta, %s : f32
  %t = math.tanh %u : f32
  %p = arith.addf %t, %one : f32
  %h = arith.mulf %x, %half : f32
  %y = arith.mulf %h, %p : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @gelu_tanh_b3 variants {gelu_tanh_b1 = #gelu_tanh_n1, gelu_tanh_b2 = #gelu_tanh_n2, gelu_tanh_b4 = #gelu_tanh_n4, gelu_tanh_b1_uniform = #gelu_tanh_u1, gelu_tanh_b2_uniform = #gelu_tanh_u2, gelu_tanh_b3_uniform = #gelu_tanh_u3, gelu_tanh_b4_uniform = #gelu_tanh_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #gelu_tanh_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #gelu_tanh_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
