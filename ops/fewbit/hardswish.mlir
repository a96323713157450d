// Hardswish with FewBit k-bit derivatives (docs/algorithms.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @hardswish_b1..b4 (N(0,1) weight, the default) and @hardswish_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// regenerate: /usr/bin/python3 tools/fewbit_solver.py --write-ops
#hardswish_n1 = #abp.buckets<borders = [4.2886748876922593e-16], levels = [0.23564314730870686, 0.7643568526912927]>
#hardswish_n2 = #abp.buckets<borders = [-0.963939802734083, 7.349374966339113e-16, 0.963939802734084], levels = [0.006011888746137689, 0.35136157609780694, 0.6486384239021934, 0.9939881112538628]>
#hardswish_n3 = #abp.buckets<borders = [-1.650306514490756, -1.0036014776313102, -0.4804886913765178, -2.0811068436721505e-16, 0.48048869137651734, 1.0036014776313105, 1.6503065144907574], levels = [-0.17290957459798775, 0.0727052316041502, 0.25822711664164283, 0.42144708910734524, 0.5785529108926546, 0.7417728833583572, 0.9272947683958503, 1.172909574597989]>
#hardswish_n4 = #abp.buckets<borders = [-3.0, -2.1690129007786214, -1.683381479721448, -1.3067984740690006, -0.984881602667484, -0.6944057050117053, -0.4225521484788404, -0.16087922311604316, 0.09711963438872945, 0.3573237261976667, 0.6259844991768648, 0.9109044676879072, 1.2234740555103507, 1.5833723627010294, 2.033246376560857], levels = [0.0, -0.31628626441945784, -0.129722336099623, 0.007468016285323823, 0.12133300100200933, 0.2220792638863349, 0.3149835994391948, 0.40331496824157853, 0.48943221634772643, 0.5753142065780932, 0.6629016108870182, 0.7544213885642256, 0.8528482565610461, 0.9628011137791876, 1.092780461354832, 1.2627171230190728]>
#hardswish_u1 = #abp.buckets<borders = [0.0], levels = [-1.9081958235743966e-19, 1.0]>
#hardswish_u2 = #abp.buckets<borders = [-3.0, -1.1970813718882554, 0.605837256223504], levels = [0.0, -0.19951356198137588, 0.40145931405587476, 1.00243219009313]>
#hardswish_u3 = #abp.buckets<borders = [-3.0, -1.9999999999999811, -0.9999999999999621, 5.739159147950094e-14, 1.000000000000049, 2.000000000000011, 3.0], levels = [0.0, -0.3333333333333302, 9.450050695673381e-15, 0.3333333333333493, 0.6666666666666842, 1.00000000000001, 1.3333333333333337, 1.0]>
#hardswish_u4 = #abp.buckets<borders = [-3.0, -2.5714285714284197, -2.1428571428568834, -1.7142857142853833, -1.2857142857138495, -0.8571428571423232, -0.42857142857076636, 7.70950932302872e-13, 0.4285714285720364, 0.8571428571431856, 1.285714285714524, 1.71428571428599, 2.1428571428574172, 2.57142857142871, 3.0], levels = [0.0, -0.42857142857140323, -0.2857142857142172, -0.14285714285704448, 1.2785723362571673e-13, 0.14285714285730453, 0.28571428571448504, 0.42857142857166725, 0.5714285714288012, 0.7142857142858702, 0.8571428571429516, 1.0000000000000857, 1.1428571428572345, 1.2857142857143546, 1.428571428571452, 1.0]>
// END GENERATED TABLES

// Hardswish: x * min(max(x + 3, 0), 6) / 6.
func.func private @activation(%x: f32) -> f32 {
  %three = arith.constant 3.0 : f32
  %zero = arith.constant 0.0 : f32
  %six = arith.constant 6.0 : f32
  %s = arith.addf %x, %three : f32
  %a = arith.maximumf %s, %zero : f32
  %b = arith.minimumf %a, %six : f32
  %p = arith.mulf %x, %b : f32
  %y = arith.divf %p, %six : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @hardswish_b3 variants {hardswish_b1 = #hardswish_n1, hardswish_b2 = #hardswish_n2, hardswish_b4 = #hardswish_n4, hardswish_b1_uniform = #hardswish_u1, hardswish_b2_uniform = #hardswish_u2, hardswish_b3_uniform = #hardswish_u3, hardswish_b4_uniform = #hardswish_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #hardswish_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #hardswish_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
