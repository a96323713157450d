// ManifestTest.cpp — parsing the fixture manifest, and every validation error naming its field.
#include "runtime/Manifest.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <functional>

using namespace abp::rt;

namespace {
std::string fixturePath() { return abp::test::dataDir() + "/test_kernels.json"; }
std::string fixtureText() { return abp::test::readText(fixturePath()); }

/// The error of parsing the fixture after `edit`; fails the test if it parses.
std::string rejection(const std::function<void(Json &)> &edit) {
  Json j = parseJson(fixtureText());
  edit(j);
  try {
    parseManifest(j.dump(), "/m/x.json");
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << j.dump();
  return "";
}

Json &member(Json &j, const char *key) { return j.at(key); }
Json &at(Json &j, size_t i) { return j.at(i); }
void erase(Json &object, const char *key) { object.erase(key); }
void popBack(Json &array) { array.erase(array.size() - 1); }
} // namespace

TEST(Manifest, ParsesTheFixture) {
  Manifest m = loadManifest(fixturePath());
  EXPECT_EQ(m.format, 1); // the fixture is format 1, which format-2 readers still read
  EXPECT_EQ(m.file, "tests/unit/data/test_kernels.cu");
  EXPECT_EQ(m.source, "test_kernels.cu");
  EXPECT_EQ(m.stem(), "test_kernels");
  EXPECT_EQ(m.directory(), abp::test::dataDir());
  EXPECT_EQ(m.sourcePath(), abp::test::dataDir() + "/test_kernels.cu");
  EXPECT_EQ(m.hostLibraryPath(), abp::test::dataDir() + "/test_kernels.host.so");
  ASSERT_EQ(m.kernels.size(), 4u);
  const KernelRecord *codes = m.findKernel("test_sign_codes");
  ASSERT_NE(codes, nullptr);
  EXPECT_EQ(codes->block, 64);
  EXPECT_EQ(codes->chunk, 8);
  ASSERT_EQ(codes->args.size(), 4u);
  EXPECT_EQ(codes->args[0].role, ArgRole::In);
  EXPECT_EQ(codes->args[0].layout, ArgLayout::Dense);
  EXPECT_EQ(codes->args[2].role, ArgRole::Out);
  EXPECT_EQ(codes->args[2].layout, ArgLayout::Packed);
  EXPECT_EQ(codes->args[2].bits, 2);
  EXPECT_EQ(codes->args[3].role, ArgRole::Count);
  EXPECT_EQ(codes->numInputs(), 1);
  EXPECT_EQ(codes->numOutputs(), 2);
  ASSERT_NE(codes->symbol("bf16"), nullptr);
  EXPECT_EQ(*codes->symbol("bf16"), "abp_test_sign_codes_bf16");
  EXPECT_EQ(codes->symbol("f64"), nullptr);
  EXPECT_EQ(codes->json.at("name"), "test_sign_codes");
  EXPECT_EQ(m.findKernel("nope"), nullptr);

  ASSERT_EQ(m.operators.size(), 3u);
  const OperatorRecord *sign = m.findOperator("test_sign");
  ASSERT_NE(sign, nullptr);
  EXPECT_EQ(sign->inputs, 1);
  EXPECT_EQ(sign->outputs, 1);
  ASSERT_EQ(sign->residuals.size(), 1u);
  EXPECT_EQ(sign->residuals[0].kind, ResidualKind::Codes);
  EXPECT_EQ(sign->residuals[0].bits, 2);
  EXPECT_EQ(sign->savedBitsPerElement, 2);
  EXPECT_EQ(sign->forward.kernel, "test_sign_codes");
  EXPECT_EQ(sign->forward.produces, (std::vector<std::string>{"result0", "result1"}));
  EXPECT_EQ(sign->backward.args, (std::vector<std::string>{"residual0"}));
  const OperatorRecord *scale = m.findOperator("test_scale");
  ASSERT_NE(scale, nullptr);
  EXPECT_EQ(scale->params, (std::vector<std::string>{"alpha"}));
  EXPECT_EQ(scale->residuals[0].kind, ResidualKind::Scalar);
  const OperatorRecord *random = m.findOperator("test_random");
  ASSERT_NE(random, nullptr);
  EXPECT_TRUE(random->backward.kernel.empty()); // "backward": null
  EXPECT_EQ(m.findOperator("nope"), nullptr);
}

TEST(Manifest, DtypeAndRoleNames) {
  EXPECT_EQ(parseDtype("f16"), Dtype::F16);
  EXPECT_EQ(parseDtype("bf16"), Dtype::BF16);
  EXPECT_EQ(parseDtype("f32"), Dtype::F32);
  EXPECT_EQ(parseDtype("f64"), Dtype::F64);
  EXPECT_FALSE(parseDtype("f128"));
  EXPECT_EQ(dtypeSize(Dtype::F64), 8u);
  EXPECT_STREQ(argRoleName(ArgRole::Rows), "rows");
  EXPECT_STREQ(argRoleName(ArgRole::Cols), "cols");
  EXPECT_STREQ(dtypeName(Dtype::BF16), "bf16");
  EXPECT_EQ(dtypeSize(Dtype::F32), 4u);
  EXPECT_EQ(dtypeSize(Dtype::F16), 2u);
  EXPECT_EQ(dtypeSize(Dtype::BF16), 2u);
  EXPECT_STREQ(argRoleName(ArgRole::Scalar), "scalar");
}

TEST(Manifest, DirectionWithNullKernelIsAccepted) {
  Json j = parseJson(fixtureText());
  Json &backward = member(at(member(j, "operators"), 2), "backward");
  backward = parseJson(R"({"kernel": null, "args": [], "produces": []})");
  Manifest m = parseManifest(j.dump(), "/m/x.json");
  EXPECT_TRUE(m.findOperator("test_random")->backward.kernel.empty());
}

TEST(Manifest, ReadsTotalKernelsAndTheDirectionsThatLaunchThem) {
  // test_scale's forward reduces its input first, reads the result as a second input and
  // saves it for backward.
  Json j = parseJson(fixtureText());
  Json &kernels = member(j, "kernels");
  kernels.push_back(parseJson(R"({"name": "test_total", "kind": "total", "reduce": "max",
    "symbols": {"f32": "abp_test_total_f32"}, "block": 64, "chunk": 8,
    "args": [{"role": "in", "layout": "dense"}, {"role": "out", "layout": "total"},
             {"role": "scratch", "values": 1025}, {"role": "count"}]})"));
  kernels.push_back(parseJson(R"({"name": "test_times_total", "symbols": {"f32": "abp_ttt_f32"},
    "block": 64, "chunk": 8,
    "args": [{"role": "in", "layout": "dense"}, {"role": "in", "layout": "total"},
             {"role": "out", "layout": "dense"}, {"role": "count"}]})"));
  Json &op = at(member(j, "operators"), 0);
  member(op, "residuals") = parseJson(R"([{"kind": "total"}])");
  member(op, "forward") = parseJson(R"({"kernel": "test_times_total", "args": ["input0", "total0"],
    "totals": [{"kernel": "test_total", "args": ["input0"]}], "produces": ["result0", "total0"]})");
  member(op, "backward") = parseJson(R"({"kernel": "test_times_total",
    "args": ["grad0", "residual0"], "produces": ["result0"]})");
  Manifest m = parseManifest(j.dump(), "/m/x.json");
  const KernelRecord *total = m.findKernel("test_total");
  ASSERT_NE(total, nullptr);
  EXPECT_EQ(total->kind, KernelKind::Total);
  EXPECT_EQ(total->args[1].layout, ArgLayout::Total);
  EXPECT_EQ(total->args[2].role, ArgRole::Scratch);
  EXPECT_EQ(total->numInputs(), 1);
  EXPECT_EQ(total->numOutputs(), 1);
  const OperatorRecord *scale = m.findOperator("test_scale");
  ASSERT_EQ(scale->forward.totals.size(), 1u);
  EXPECT_EQ(scale->forward.totals[0].kernel, "test_total");
  EXPECT_EQ(scale->forward.totals[0].args, std::vector<std::string>{"input0"});
  EXPECT_EQ(scale->residuals[0].kind, ResidualKind::Total);
  EXPECT_STREQ(argRoleName(ArgRole::Scratch), "scratch");

  // A total fed to a plain input, a tensor to a total input, a total kernel as the kernel.
  Json wrong = j;
  at(member(member(at(member(wrong, "operators"), 0), "forward"), "args"), 0) = Json("total0");
  EXPECT_THROW(parseManifest(wrong.dump(), "/m/x.json"), Error);
  wrong = j;
  at(member(member(at(member(wrong, "operators"), 0), "backward"), "args"), 1) = Json("grad0");
  EXPECT_THROW(parseManifest(wrong.dump(), "/m/x.json"), Error);
  wrong = j;
  member(member(at(member(wrong, "operators"), 0), "forward"), "kernel") = Json("test_total");
  EXPECT_THROW(parseManifest(wrong.dump(), "/m/x.json"), Error);

  // A total is one value: a residual of kind total, never an output or a gradient; such a
  // residual holds a total; a total kernel combines whole warps.
  auto refused = [&](const std::function<void(Json &)> &edit, const std::string &want) {
    Json edited = j;
    edit(edited);
    try {
      parseManifest(edited.dump(), "/m/x.json");
      ADD_FAILURE() << "accepted: " << want;
    } catch (const Error &e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  auto produces = [](Json &m, const char *direction) -> Json & {
    return member(member(at(member(m, "operators"), 0), direction), "produces");
  };
  refused([&](Json &m) { std::swap(at(produces(m, "forward"), 0), at(produces(m, "forward"), 1)); },
          "operators[0].forward.produces[0]: \"total0\" is a total (one value): only a residual of "
          "kind \"total\" holds one");
  refused([&](Json &m) { at(produces(m, "forward"), 1) = Json("input0"); },
          "operators[0].forward.produces[1]: \"input0\" is not a total, but the residual it feeds "
          "has kind total");
  refused([&](Json &m) {
            member(at(member(m, "operators"), 0), "backward")["totals"] = parseJson(
                R"([{"kernel": "test_total", "args": ["grad0"]}])");
            at(produces(m, "backward"), 0) = Json("total0");
          },
          "operators[0].backward.produces[0]: \"total0\" is a total (one value), not a gradient");
  refused([&](Json &m) { member(at(member(m, "kernels"), 4), "block") = Json(48); },
          "kernels[4].block: a total kernel needs whole warps, got 48");
}

TEST(Manifest, RejectsInvalidManifestsNamingFileAndField) {
  struct Case {
    std::function<void(Json &)> edit;
    const char *want;
  };
  auto kernelArg = [](Json &j, size_t k, size_t a) -> Json & {
    return at(member(at(member(j, "kernels"), k), "args"), a);
  };
  auto op = [](Json &j, size_t i) -> Json & { return at(member(j, "operators"), i); };
  const Case cases[] = {
      // A forward kernel writing wider codes than its residual holds wrote past the buffer the
      // binding sized from the residual (heap corruption at the first call).
      {[&](Json &j) { member(kernelArg(j, 1, 2), "bits") = Json(4); },
       "operators[1].forward.produces[1]: \"result1\" is 4-bit codes as kernel "
       "\"test_sign_codes\" writes it, but it becomes 2-bit codes (residual 0)"},
      {[&](Json &j) { member(kernelArg(j, 1, 1), "layout") = Json("packed"); kernelArg(j, 1, 1)["bits"] = Json(8); },
       "operators[1].forward.produces[0]: \"result0\" is 8-bit codes as kernel "
       "\"test_sign_codes\" writes it, but it becomes output 0"},
      {[&](Json &j) { member(op(j, 1), "residuals") = Json::array({Json{{"kind", "tensor"}, {"bits", 32}}}); },
       "operators[1].forward.produces[1]: \"result1\" is 2-bit codes as kernel "
       "\"test_sign_codes\" writes it, but it becomes residual 0, not codes"},
      {[&](Json &j) {
         member(op(j, 0), "tables") = Json::array({Json{{"borders", Json::array({0.5})}, {"levels", Json::array({1.0})}}});
       },
       "operators[0].tables[0].levels: expected 2 levels (one more than the 1 borders), got 1"},
      {[&](Json &j) {
         member(op(j, 0), "tables") =
             Json::array({Json{{"borders", Json::array({0.5, 0.5})}, {"levels", Json::array({1.0, 2.0, 3.0})}}});
       },
       "operators[0].tables[0].borders[1]: borders must increase strictly"},
      {[](Json &j) { member(j, "format") = Json(5); },
       "format: unsupported manifest format 5 (this runtime reads formats 1 to 4)"},
      {[](Json &j) { member(j, "format") = Json(0); },
       "format: unsupported manifest format 0"},
      {[&](Json &j) { member(kernelArg(j, 0, 0), "layout") = Json("rows"); },
       "kernels[0].args[0].layout: the \"rows\" layout is only valid in a row kernel"},
      {[&](Json &j) { member(kernelArg(j, 0, 0), "layout") = Json("cols"); },
       "kernels[0].args[0].layout: the \"cols\" layout is only valid for inputs of a row kernel"},
      {[&](Json &j) { member(member(op(j, 0), "backward"), "produces") = Json::array({"colsum0"}); },
       "operators[0].backward.produces[0]: \"colsum0\" is out of range (0 colsums available)"},
      {[&](Json &j) {
         member(op(j, 0), "residuals") = Json::array({Json{{"kind", "cols"}, {"bits", 32}}});
         member(member(op(j, 0), "forward"), "produces") = Json::array({"result0", "input0"});
       },
       "operators[0].backward.args[1]: \"residual0\" feeds argument 1 of kernel \"test_scale\", which is "
       "not a \"cols\" input, but the residual holds one value per column"},
      {[](Json &j) { at(member(j, "kernels"), 0)["kind"] = Json("tiles"); },
       "kernels[0].kind: expected \"elementwise\", \"rows\" or \"total\""},
      {[](Json &j) { at(member(j, "kernels"), 0)["kind"] = Json("total"); },
       "kernels[0]: missing required member \"reduce\""},
      {[](Json &j) {
         Json &k = at(member(j, "kernels"), 0);
         k["kind"] = Json("total");
         k["reduce"] = Json("product");
       },
       "kernels[0].reduce: expected sum, mean, max or min, got \"product\""},
      {[](Json &j) {
         Json &k = at(member(j, "kernels"), 0);
         k["kind"] = Json("total");
         k["reduce"] = Json("sum");
       },
       "kernels[0].args[2]: a total kernel's argument before the count must be its scratch"},
      {[&](Json &j) { member(kernelArg(j, 0, 2), "role") = Json("scratch"); },
       "kernels[0].args[2]: only a total kernel takes a scratch argument"},
      {[&](Json &j) { member(kernelArg(j, 0, 2), "layout") = Json("total"); },
       "kernels[0].args[2].layout: only a total kernel writes a \"total\" output"},
      {[&](Json &j) {
         at(member(member(op(j, 0), "forward"), "args"), 0) = Json("total0");
       },
       "operators[0].forward.args[0]: \"total0\" is out of range (0 totals available)"},
      {[&](Json &j) {
         member(op(j, 0), "forward")["totals"] =
             parseJson(R"([{"kernel": "test_scale", "args": ["input0", "param0"]}])");
       },
       "operators[0].forward.totals[0].kernel: names \"test_scale\", which is not a total kernel"},
      {[](Json &j) {
         Json &k = at(member(j, "kernels"), 0);
         k["kind"] = Json("rows");
         k["warp_max_cols"] = Json(1024);
       },
       "kernels[0].args[2]: a row kernel's last two arguments must be rows and cols"},
      {[](Json &j) { at(member(j, "kernels"), 0)["kind"] = Json("rows"); },
       "kernels[0]: missing required member \"warp_max_cols\""},
      {[&](Json &j) {
         Json &r = at(member(op(j, 1), "residuals"), 0);
         member(r, "kind") = Json("shared");
         r["output"] = Json(3);
       },
       "operators[1].residuals[0].output: expected an integer in [0, 0], got 3"},
      {[&](Json &j) { op(j, 0)["row_wise"] = Json(1); },
       "operators[0].row_wise: expected true or false"},
      {[](Json &j) { erase(j, "source"); }, "missing required member \"source\""},
      {[](Json &j) { member(j, "source") = Json(""); }, "source: expected a non-empty"},
      {[](Json &j) { member(j, "kernels") = Json::object(); }, "kernels: expected an array"},
      {[&](Json &j) { member(kernelArg(j, 0, 1), "role") = Json("inout"); },
       "kernels[0].args[1].role: unknown role \"inout\""},
      {[&](Json &j) { member(kernelArg(j, 1, 2), "bits") = Json(9); },
       "kernels[1].args[2].bits: expected an integer in [1, 8], got 9"},
      {[&](Json &j) { member(kernelArg(j, 1, 2), "bits") = Json(0); },
       "kernels[1].args[2].bits: expected an integer in [1, 8], got 0"},
      {[&](Json &j) { member(kernelArg(j, 1, 2), "bits") = Json(1.5); },
       "kernels[1].args[2].bits: expected an integer in [1, 8], got 1.5"},
      {[&](Json &j) { std::swap(kernelArg(j, 0, 2), kernelArg(j, 0, 3)); },
       "kernels[0].args[2]: the count argument must be last"},
      {[&](Json &j) { popBack(member(at(member(j, "kernels"), 2), "args")); },
       "kernels[2].args[1]: the last argument must be the count"},
      {[&](Json &j) { std::swap(kernelArg(j, 1, 0), kernelArg(j, 1, 1)); },
       "kernels[1].args[1]: inputs and scalars must come before the outputs"},
      {[&](Json &j) { member(kernelArg(j, 0, 1), "type") = Json("f64"); },
       "kernels[0].args[1].type: unsupported scalar type \"f64\""},
      {[&](Json &j) { member(kernelArg(j, 0, 0), "layout") = Json("strided"); },
       "kernels[0].args[0].layout: unknown layout \"strided\""},
      {[](Json &j) {
         member(at(member(j, "kernels"), 0), "symbols")["f128"] = Json("abp_x");
       },
       "kernels[0].symbols.f128: unknown dtype \"f128\""},
      {[](Json &j) {
         member(at(member(j, "kernels"), 0), "symbols")["f16"] = Json("not an id");
       },
       "kernels[0].symbols.f16: expected a C identifier"},
      {[](Json &j) {
         member(at(member(j, "kernels"), 1), "symbols")
             ["f16"] = Json("abp_test_scale_f16");
       },
       "appears twice in the manifest"},
      {[](Json &j) { member(at(member(j, "kernels"), 1), "name") = Json("test_scale"); },
       "kernels[1].name: kernel \"test_scale\" appears twice"},
      {[](Json &j) { member(at(member(j, "kernels"), 0), "block") = Json(0); },
       "kernels[0].block: expected an integer in [1, 1024], got 0"},
      {[](Json &j) { member(at(member(j, "kernels"), 0), "block") = Json(2048); },
       "kernels[0].block: expected an integer in [1, 1024], got 2048"},
      {[](Json &j) { member(at(member(j, "kernels"), 1), "chunk") = Json(3); },
       "kernels[1].args[2].bits: chunk (3) * bits (2) must fill whole bytes"},
      {[&](Json &j) { member(member(op(j, 0), "forward"), "kernel") = Json("nope"); },
       "operators[0].forward.kernel: names kernel \"nope\", which is not in \"kernels\""},
      {[&](Json &j) {
         at(member(member(op(j, 0), "forward"), "args"), 0) = Json("input1");
       },
       "operators[0].forward.args[0]: \"input1\" is out of range (1 input available)"},
      {[&](Json &j) { at(member(member(op(j, 0), "forward"), "args"), 0) = Json("foo0"); },
       "\"foo0\" is not a reference"},
      {[&](Json &j) { member(member(op(j, 0), "forward"), "args").push_back("input0"); },
       "operators[0].forward.args: kernel \"test_scale\" takes 2 inputs and scalars, but 3"},
      {[&](Json &j) {
         std::swap(at(member(member(op(j, 0), "forward"), "args"), 0),
                   at(member(member(op(j, 0), "forward"), "args"), 1));
       },
       "operators[0].forward.args[0]: \"param0\" feeds argument 0 of kernel \"test_scale\", "
       "whose role is in"},
      {[&](Json &j) { member(at(member(op(j, 1), "residuals"), 0), "bits") = Json(9); },
       "operators[1].residuals[0].bits: expected an integer in [1, 8], got 9"},
      {[&](Json &j) { member(at(member(op(j, 1), "residuals"), 0), "bits") = Json(4); },
       "operators[1].backward.args[0]: \"residual0\" holds 4-bit codes"},
      {[&](Json &j) {
         member(at(member(op(j, 1), "residuals"), 0), "kind") = Json("blob");
       },
       "operators[1].residuals[0].kind: unknown residual kind \"blob\""},
      {[&](Json &j) { popBack(member(member(op(j, 1), "forward"), "produces")); },
       "operators[1].forward.produces: expected 2 references, got 1"},
      {[&](Json &j) { member(op(j, 0), "saved_bits_per_element") = Json(-1); },
       "operators[0].saved_bits_per_element: expected a non-negative number"},
      {[&](Json &j) { member(op(j, 2), "name") = Json("test_scale"); },
       "operators[2].name: operator \"test_scale\" appears twice"},
      {[&](Json &j) { member(op(j, 0), "params") = parseJson("[1]"); },
       "operators[0].params[0]: expected a parameter name"},
  };
  for (const Case &c : cases) {
    std::string message = rejection(c.edit);
    EXPECT_EQ(message.rfind("manifest /m/x.json: ", 0), 0u) << message;
    EXPECT_NE(message.find(c.want), std::string::npos)
        << "want: " << c.want << "\ngot:  " << message;
  }
}

TEST(Manifest, RejectsBadJsonAndNonObjects) {
  try {
    parseManifest("{\"format\": 1,", "/m/bad.json");
    FAIL() << "accepted truncated JSON";
  } catch (const Error &e) {
    // Where the text ends, in the words of the JSON library's parser.
    EXPECT_EQ(std::string(e.what()).rfind("manifest /m/bad.json: parse error at line 1, column 14: ", 0), 0u)
        << e.what();
  }
  try {
    parseManifest("[]", "/m/array.json");
    FAIL() << "accepted an array";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("expected an object, got an array"), std::string::npos);
  }
}

TEST(Manifest, MissingFileIsAnIoError) {
  try {
    loadManifest("/nonexistent/dir/x.json");
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::Io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/x.json"), std::string::npos);
  }
}

namespace {
/// A format-2 manifest with a gathered row kernel and an operator with no_grad inputs, like
/// ops/sample's sample_rows (docs/manifest.md).
const char *kGatherManifest = R"({
  "format": 2, "file": "ops/sample/sample.mlir", "source": "sample.cu", "host_library": "",
  "operators": [{
    "name": "sample_rows", "inputs": 4, "outputs": 0, "params": [], "row_wise": true,
    "no_grad": [1, 2, 3],
    "residuals": [{"kind": "tensor", "bits": 32}, {"kind": "rows", "bits": 32}],
    "saved_bits_per_element": 32, "saved_bits_per_row": 32, "tables": [],
    "forward": {"kernel": "g_fwd", "args": ["input0", "input1", "input2"], "produces": ["result0", "input3"]},
    "backward": {"kernel": "g_bwd", "args": ["residual0", "residual1"], "produces": ["result0"]}}],
  "kernels": [
    {"name": "g_fwd", "kind": "rows", "warp_max_cols": 1024, "symbols": {"f32": "abp_g_fwd_f32"},
     "block": 256, "chunk": 8,
     "args": [{"role": "in", "layout": "gathered", "by": 1}, {"role": "in", "layout": "rows", "type": "i32"},
              {"role": "in", "layout": "rows"}, {"role": "out", "layout": "dense"}, {"role": "rows"}, {"role": "cols"}]},
    {"name": "g_bwd", "kind": "rows", "warp_max_cols": 1024, "symbols": {"f32": "abp_g_bwd_f32"},
     "block": 256, "chunk": 8,
     "args": [{"role": "in", "layout": "gathered", "by": 1}, {"role": "in", "layout": "rows", "type": "i32"},
              {"role": "out", "layout": "dense"}, {"role": "rows"}, {"role": "cols"}]}]
})";

std::string gatherRejection(const std::function<void(Json &)> &edit) {
  Json j = parseJson(kGatherManifest);
  edit(j);
  try {
    parseManifest(j.dump(), "/m/g.json");
  } catch (const Error &e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << j.dump();
  return "";
}
} // namespace

TEST(Manifest, ParsesGatheredRowsAndNoGradInputs) {
  Manifest m = parseManifest(kGatherManifest, "/m/g.json");
  const KernelRecord *fwd = m.findKernel("g_fwd");
  ASSERT_NE(fwd, nullptr);
  EXPECT_EQ(fwd->args[0].layout, ArgLayout::Gathered);
  EXPECT_EQ(fwd->args[0].by, 1);
  EXPECT_EQ(fwd->args[1].layout, ArgLayout::Rows);
  EXPECT_TRUE(fwd->args[1].rowIndex);
  EXPECT_FALSE(fwd->args[2].rowIndex); // compute-type rows have no type
  const OperatorRecord *op = m.findOperator("sample_rows");
  ASSERT_NE(op, nullptr);
  EXPECT_EQ(op->noGrad, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(op->backward.produces.size(), 1u); // one gradient: inputs without no_grad
}

TEST(Manifest, RejectsBadGatheredArgumentsAndNoGradLists) {
  auto arg = [](Json &j, size_t k, size_t a) -> Json & {
    return at(member(at(member(j, "kernels"), k), "args"), a);
  };
  auto op = [](Json &j) -> Json & { return at(member(j, "operators"), 0); };
  struct Case {
    std::function<void(Json &)> edit;
    const char *want;
  };
  const Case cases[] = {
      {[&](Json &j) { member(arg(j, 0, 0), "by") = Json(2); },
       "kernels[0].args[0].by: must name an i32 rows input (the row indices), got argument 2"},
      {[&](Json &j) { member(arg(j, 0, 0), "by") = Json(9); },
       "kernels[0].args[0].by: expected an integer in [0, 5], got 9"},
      {[&](Json &j) { member(arg(j, 0, 1), "type") = Json("f32"); },
       "kernels[0].args[1].type: a rows input's type must be \"i32\""},
      {[&](Json &j) { member(arg(j, 0, 3), "layout") = Json("gathered"); },
       "kernels[0].args[3].layout: the \"gathered\" layout is only valid for inputs of a row kernel"},
      {[&](Json &j) { member(op(j), "no_grad") = parseJson("[4]"); },
       "operators[0].no_grad[0]: expected an integer in [0, 3], got 4"},
      {[&](Json &j) { member(op(j), "no_grad") = parseJson("[1, 1]"); },
       "operators[0].no_grad[1]: lists input 1 twice"},
      {[&](Json &j) { member(op(j), "no_grad") = parseJson("[1, 2]"); },
       "operators[0].backward.produces: expected 2 references, got 1"},
  };
  for (const Case &c : cases) {
    std::string message = gatherRejection(c.edit);
    EXPECT_NE(message.find(c.want), std::string::npos)
        << "want: " << c.want << "\ngot:  " << message;
  }
}
