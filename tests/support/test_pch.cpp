// Compiles the Catch2 tests' precompiled header (tests/CMakeLists.txt: weft_test_pch), which the
// tests reuse; nothing of its own.
