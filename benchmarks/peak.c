/* This core's clock and peak multiply-add rates, for the roofline column of benchmarks/openvino_peer.py.
 *
 *   cc -O2 -march=native benchmarks/peak.c -o /tmp/peak && /tmp/peak
 *
 * Prints one JSON line: the ISA the int8 and bf16 figures are for, the clock (GHz, from a chain of
 * dependent adds: one per cycle on every x86-64 core), and how many int8 and bf16 multiply-adds one
 * core completes per cycle (from 12 independent chains of vpdpbusd / vdpbf16ps, or AVX2's
 * vpmaddubsw: 32 byte products per instruction). One thread: run it while the machine is idle. */
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define N 20000000L
#define TWELVE(I)                                                                                       \
    I "0\n" I "1\n" I "2\n" I "3\n" I "4\n" I "5\n" I "6\n" I "7\n" I "8\n" I "9\n" I "10\n" I "11\n"
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"

/* seconds for N rounds of 12 independent instructions */
#define TIME(ASM)                                                                                       \
    do {                                                                                                \
        double t0 = now();                                                                              \
        for (long k = 0; k < N; k++) __asm__ volatile(ASM ::: CLOBBER);                                 \
        secs = now() - t0;                                                                              \
    } while (0)

int main(void) {
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) { /* the clock: 12 dependent adds a round */
        unsigned long x = 0;
        double t0 = now();
        for (long k = 0; k < N; k++)
            __asm__ volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
                             "add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
                             : "+r"(x));
        const double s = now() - t0;
        best = s < best ? s : best;
    }
    const double hz = 12.0 * N / best;
    double secs = 0.0, int8 = 0.0, bf16 = 0.0;
    const char *isa = "none";
#define ZMM(OP) OP " %%zmm30, %%zmm31, %%zmm"
#define YMM(OP) OP " %%ymm14, %%ymm15, %%ymm"
#if defined(__AVX512VNNI__)
    TIME(TWELVE(ZMM("vpdpbusd")));
    int8 = 12.0 * N * 64 / secs / hz, isa = "avx512-vnni";
#elif defined(__AVXVNNI__)
    TIME(TWELVE(YMM("vpdpbusd")));
    int8 = 12.0 * N * 32 / secs / hz, isa = "avx-vnni";
#elif defined(__AVX2__)
    TIME(TWELVE(YMM("vpmaddubsw")));
    int8 = 12.0 * N * 32 / secs / hz, isa = "avx2";
#endif
#if defined(__AVX512BF16__)
    TIME(TWELVE(ZMM("vdpbf16ps")));
    bf16 = 12.0 * N * 32 / secs / hz;
#endif
    printf("{\"isa\": \"%s\", \"clock_ghz\": %.3f, \"int8_macs_per_cycle\": %.1f, \"bf16_macs_per_cycle\": %.1f}\n",
           isa, hz * 1e-9, int8, bf16);
    return 0;
}
