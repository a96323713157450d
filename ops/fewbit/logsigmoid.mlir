// LogSigmoid with FewBit k-bit derivatives (docs/algorithms.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @logsigmoid_b1..b4 (N(0,1) weight, the default) and @logsigmoid_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// regenerate: /usr/bin/python3 tools/fewbit_solver.py --write-ops
#logsigmoid_n1 = #abp.buckets<borders = [0.0], levels = [0.6748568252669757, 0.3251431747330235]>
#logsigmoid_n2 = #abp.buckets<borders = [-0.7970874127516168, -3.2134832358554693e-15, 0.797087412751611], levels = [0.7864981062186636, 0.59220410576071, 0.40779589423929125, 0.21350189378133752]>
#logsigmoid_n3 = #abp.buckets<borders = [-1.3958270660012553, -0.821622346527281, -0.38836984429245563, -1.1926242627478345e-15, 0.38836984429245414, 0.8216223465272794, 1.3958270660012524], levels = [0.8580163390580006, 0.7450254046562957, 0.6441358167129565, 0.547644605248661, 0.45235539475133935, 0.35586418328704394, 0.25497459534370454, 0.14198366094199882]>
#logsigmoid_n4 = #abp.buckets<borders = [-1.902845832192535, -1.4314847926796943, -1.1038039470630991, -0.838604493192883, -0.6072606098580181, -0.3956557176485642, -0.1952644072359231, -3.564059937082979e-14, 0.19526440723585678, 0.3956557176485054, 0.6072606098579637, 0.8386044931928361, 1.1038039470630632, 1.4314847926796657, 1.9028458321925108], levels = [0.9041387490450642, 0.8362878084590482, 0.7779773080360339, 0.7239670359024971, 0.6723754136248371, 0.6222559007655946, 0.5730310063496755, 0.5242921639125376, 0.4757078360874796, 0.4269689936503399, 0.37774409923441865, 0.327624586375174, 0.27603296409751105, 0.22202269196397187, 0.16371219154095548, 0.09586125095493729]>
#logsigmoid_u1 = #abp.buckets<borders = [-2.8138160885326323e-16], levels = [0.9930685281943497, 0.006931471805599464]>
#logsigmoid_u2 = #abp.buckets<borders = [-1.689309838338744, 5.5754961515969784e-14, 1.6893098383388494], levels = [0.9982764359710752, 0.6899903147088084, 0.31000968529116957, 0.0017235640288822923]>
#logsigmoid_u3 = #abp.buckets<borders = [-2.920579680515612, -1.5571359956290936, -0.7093164643855898, 4.5140287556176444e-14, 0.7093164643857431, 1.5571359956291726, 2.9205796805153796], levels = [0.9994592069415424, 0.8982496693011182, 0.753634336304402, 0.5868658753690927, 0.41313412463087795, 0.24636566369557616, 0.10175033069888596, 0.000540793058421177]>
#logsigmoid_u4 = #abp.buckets<borders = [-4.0345421858554396, -2.7498745148809562, -2.0236371657469046, -1.4952310878365676, -1.0636849922324698, -0.6853354090394025, -0.3361341107807157, 1.2928961897564345e-12, 0.3361341107831607, 0.6853354090416058, 1.0636849922347558, 1.4952310878391828, 2.023637165749394, 2.749874514882698, 4.034542185856432], levels = [0.999817235633295, 0.9654104603763386, 0.914402064636604, 0.8521110881441121, 0.7816131766167566, 0.7051750675673323, 0.6246818588415665, 0.5418204364671287, 0.4581795635322482, 0.37531814115788975, 0.29482493243220226, 0.21838682338282708, 0.1478889118555669, 0.08559793536322802, 0.034589539623613635, 0.00018276436667304707]>
// END GENERATED TABLES

// LogSigmoid: min(x, 0) - log1p(exp(-|x|)), the stable form torch uses.
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %m = arith.minimumf %x, %zero : f32
  %a = math.absf %x : f32
  %n = arith.negf %a : f32
  %e = math.exp %n : f32
  %l = math.log1p %e : f32
  %y = arith.subf %m, %l : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @logsigmoid_b3 variants {logsigmoid_b1 = #logsigmoid_n1, logsigmoid_b2 = #logsigmoid_n2, logsigmoid_b4 = #logsigmoid_n4, logsigmoid_b1_uniform = #logsigmoid_u1, logsigmoid_b2_uniform = #logsigmoid_u2, logsigmoid_b3_uniform = #logsigmoid_u3, logsigmoid_b4_uniform = #logsigmoid_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #logsigmoid_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #logsigmoid_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
