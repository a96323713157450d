// SELU with FewBit k-bit derivatives (docs/algorithms.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @selu_b1..b4 (N(0,1) weight, the default) and @selu_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// regenerate: /usr/bin/python3 tools/fewbit_solver.py --write-ops
#selu_n1 = #abp.buckets<borders = [-0.7723697068828296], levels = [0.5029845565139787, 1.1212079597649456]>
#selu_n2 = #abp.buckets<borders = [-0.9427570164308224, -0.382979889657286, 0.0], levels = [0.4362571038341711, 0.9334863600576688, 1.4639514703858245, 1.0507009873554771]>
#selu_n3 = #abp.buckets<borders = [-1.5570916672560056, -1.0852416348153566, -0.7714468627667836, -0.5290511766138793, -0.32809020775229236, -0.15437693691233365, 0.0], levels = [0.2561374800889042, 0.48489473375843317, 0.7029480215017105, 0.9227440631116725, 1.1488726214597522, 1.3838383982961808, 1.6293643504107842, 1.0507009873554771]>
#selu_n4 = #abp.buckets<borders = [-2.0549492939491008, -1.637814977604148, -1.3643702246650564, -1.1559038458629072, -0.9852116741952817, -0.8394252556249003, -0.7113783149360078, -0.596648149919131, -0.4923034159279473, -0.39629615358610615, -0.30713630755149396, -0.2237041695701126, -0.14513588569693017, -0.07075023933804529, 0.0], levels = [0.16359339008348123, 0.28682930808600715, 0.396735033697529, 0.501799859505696, 0.6050042039072933, 0.707804396423565, 0.8110482781487512, 0.9152893233652505, 1.0209204484289185, 1.1282395559818483, 1.2374849794845328, 1.3488561317614263, 1.462526259420321, 1.5786507067218827, 1.697372489976951, 1.0507009873554771]>
#selu_u1 = #abp.buckets<borders = [-1.2031682895766425], levels = [0.005342826170682724, 1.0503657699153348]>
#selu_u2 = #abp.buckets<borders = [-2.6784020685592873, -1.4305311089768153, -0.7548732917785057], levels = [0.0012405633349507163, 0.2402266488501791, 0.6007842809708592, 1.052075840625831]>
#selu_u3 = #abp.buckets<borders = [-3.270098046556235, -2.022279614883114, -1.3466368593053475, -0.8818073496048439, -0.527249841018465, -0.24060046869255067, 0.0], levels = [0.0006907121994397107, 0.1329343344602662, 0.3324465376828798, 0.5821645240649586, 0.8736610382551496, 1.2016906862104593, 1.5625888001193826, 1.050700987355478]>
#selu_u4 = #abp.buckets<borders = [-4.4429502315235565, -3.1952378488090747, -2.519625503154789, -2.054810313166443, -1.7002611196754556, -1.4136171771300363, -1.1730205317694076, -0.9657124194609771, -0.7835950013530865, -0.6212063870995458, -0.47468808666866324, -0.34121312997036213, -0.21864835406245273, -0.10534447638447413, 0.0], levels = [0.0002163873704228887, 0.04113829007911752, 0.10287389524125616, 0.1801440374201893, 0.2703412651987278, 0.3718425925072646, 0.48351411864391797, 0.6045063423677387, 0.7341522560733588, 0.8719101691160502, 1.017328824305977, 1.170024749749445, 1.3296668299235361, 1.4959653838328082, 1.668664187644092, 1.050700987355478]>
// END GENERATED TABLES

// SELU: x <= 0 ? expm1(x) * alpha * scale : x * scale, torch's constants in fp32.
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %negcoef = arith.constant 1.7580993175506592 : f32
  %scale = arith.constant 1.0507010221481323 : f32
  %m = math.expm1 %x : f32
  %n = arith.mulf %m, %negcoef : f32
  %p = arith.mulf %x, %scale : f32
  %neg = arith.cmpf ole, %x, %zero : f32
  %y = arith.select %neg, %n, %p : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @selu_b3 variants {selu_b1 = #selu_n1, selu_b2 = #selu_n2, selu_b4 = #selu_n4, selu_b1_uniform = #selu_u1, selu_b2_uniform = #selu_u2, selu_b3_uniform = #selu_u3, selu_b4_uniform = #selu_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #selu_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #selu_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
