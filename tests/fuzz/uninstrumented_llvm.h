// uninstrumented_llvm.h — force-included (-include) into every object of the fuzz tree.
//
// Debian's LLVM and MLIR libraries are not built with AddressSanitizer, but their headers
// poison and unpoison BumpPtrAllocator slabs whenever the including object is. Inline copies
// from our objects then poison memory that the uninstrumented library code hands out without
// unpoisoning, and ASan reports a use-after-poison inside MLIRContext's constructor. Declaring
// the interface first and turning the two calls into no-ops keeps both sides in agreement
// (llvm/Support/Compiler.h includes the same header, which its guard then skips).
#pragma once
#include <sanitizer/asan_interface.h>
#define __asan_poison_memory_region(addr, size) ((void)(addr), (void)(size))
#define __asan_unpoison_memory_region(addr, size) ((void)(addr), (void)(size))
