# lit configuration of abp's FileCheck tests (dialect, passes, codegen, ops).
import os

import lit.formats

config.name = "abp"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.abp_obj_root, "tests", "lit")
config.excludes = ["CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py.in"]
config.substitutions.append(("%abp_src", config.abp_src_root))
config.substitutions.append(("%abp_kernels", os.path.join(config.abp_obj_root, "kernels")))
config.environment["PATH"] = os.pathsep.join(
    [config.abp_tools_dir, config.llvm_tools_dir, config.environment.get("PATH", "")])
