// Every scalar operation the verifier admits (dialect/ScalarOps.cpp) translates, and the result
// builds for the host and through NVRTC. The third RUN line turns that list into CHECK-DAG lines
// over this file, so an op added to the list without a use here fails.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=host -o %t.so && abp-compile %s --emit=ptx --arch=sm_80 -o %t.ptx
// RUN: grep -o '"[a-z]*\.[a-z0-9]*"' %abp_src/dialect/ScalarOps.cpp | sed 's/"\(.*\)"/CHECK-DAG: {{[ ]}}\1{{[ ]}}/' > %t.check && FileCheck %t.check --input-file %s

// CHECK-DAG: abp::fmod(
// CHECK-DAG: abp::toSignedSat<int>(
// CHECK-DAG: abp::toUnsignedSat<abp::u32>(
// CHECK-DAG: abp::roundeven(
// CHECK-DAG: abp::round(
// CHECK-DAG: abp::copysign(
// CHECK-DAG: abp::exp2(
// CHECK-DAG: abp::log2(
// CHECK-DAG: abp::sin(
// CHECK-DAG: abp::ceil(
// CHECK-DAG: abp::trunc(

func.func private @half(%v: f32) -> f32 {
  %h = arith.constant 0.5 : f32
  %r = arith.mulf %v, %h : f32
  func.return %r : f32
}

abp.operator @every_scalar_op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %one = arith.constant 1.0 : f32
    %a1 = arith.addf %v, %one : f32
    %a2 = arith.subf %a1, %v : f32
    %a3 = arith.mulf %a2, %v : f32
    %a4 = arith.divf %a3, %a1 : f32
    %a5 = arith.remf %a4, %a1 : f32
    %a6 = arith.negf %a5 : f32
    %a7 = arith.maximumf %a6, %v : f32
    %a8 = arith.minimumf %a7, %v : f32
    %a9 = arith.maxnumf %a8, %v : f32
    %a10 = arith.minnumf %a9, %v : f32
    %m1 = math.absf %a10 : f32
    %m2 = math.ceil %m1 : f32
    %m3 = math.copysign %m2, %v : f32
    %m4 = math.cos %m3 : f32
    %m5 = math.erf %m4 : f32
    %m6 = math.exp %m5 : f32
    %m7 = math.exp2 %m6 : f32
    %m8 = math.expm1 %m7 : f32
    %m9 = math.floor %m8 : f32
    %m10 = math.log %m9 : f32
    %m11 = math.log1p %m10 : f32
    %m12 = math.log2 %m11 : f32
    %m13 = math.powf %m12, %one : f32
    %m14 = math.round %m13 : f32
    %m15 = math.roundeven %m14 : f32
    %m16 = math.rsqrt %m15 : f32
    %m17 = math.sin %m16 : f32
    %m18 = math.sqrt %m17 : f32
    %m19 = math.tanh %m18 : f32
    %m20 = math.trunc %m19 : f32
    %i1 = arith.fptosi %m20 : f32 to i32
    %i2 = arith.fptoui %v : f32 to i32
    %i3 = arith.addi %i1, %i2 : i32
    %i4 = arith.subi %i3, %i2 : i32
    %i5 = arith.muli %i4, %i3 : i32
    %i6 = arith.andi %i5, %i3 : i32
    %i7 = arith.ori %i6, %i4 : i32
    %i8 = arith.xori %i7, %i5 : i32
    %i9 = arith.minui %i8, %i7 : i32
    %n8 = arith.trunci %i9 : i32 to i8
    %s32 = arith.extsi %n8 : i8 to i32
    %pos = arith.cmpi sgt, %s32, %i8 : i32
    %u32 = arith.extui %pos : i1 to i32
    %f1 = arith.uitofp %u32 : i32 to f32
    %f2 = arith.sitofp %s32 : i32 to f32
    %big = arith.cmpf ogt, %f1, %f2 : f32
    %f3 = arith.select %big, %f1, %f2 : f32
    %f4 = func.call @half(%f3) : (f32) -> f32
    abp.yield %f4 : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
