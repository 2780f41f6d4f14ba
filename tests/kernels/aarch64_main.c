/* The executable the aarch64 emulator test runs (tests/kernels/test_kernels_aarch64_build.py): musl starts it, the
 * emulator stops it at main and then calls the kernels' entry points itself (linked with --no-gc-sections, so that
 * nothing here needs to name them). */
int main(void) { return 0; }
