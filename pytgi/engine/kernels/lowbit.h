/* The packed low-bit layouts' sizes, shared by the kernels that read them (qgemv.c, which describes
 * each format) and the packer that writes them (pack.c). A block holds 16 output rows × 32 inputs. */
#ifndef PYTGI_LOWBIT_H
#define PYTGI_LOWBIT_H
#include <stdint.h>

#define NIBBLES(bits) ((bits) == 4 || (bits) == 5) /* formats stored two values a byte */
#define HALVES(bits) ((bits) == 16 || (bits) == 6) /* formats with a scale per 16 inputs */
/* the weights' bytes: two levels a byte, those and the high 2 bits (bits 6) or the high bit (bits 7),
 * or a level a byte */
#define WEIGHT_BYTES(bits) (NIBBLES(bits) ? 256 : (bits) == 6 ? 384 : (bits) == 7 ? 320 : 512)
/* the bytes after them: fp16 d and m (per 16 inputs for bits 16), MXFP4's exponents, bits 6's two d,
 * bits 7's one d */
#define TAIL_BYTES(bits) ((bits) == 16 ? 128 : (bits) == 5 ? 16 : (bits) == 7 ? 32 : 64)

/* Bytes of one (tile, group) block in format `bits` (4, 5, 6, 7, 8 or 16). */
static inline int64_t block_bytes(int64_t bits) { return WEIGHT_BYTES(bits) + TAIL_BYTES(bits); }
#endif
