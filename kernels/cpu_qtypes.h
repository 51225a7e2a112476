/* GGUF block types as the qdot kernels read them: packed units, the tile they unpack into.
 *
 * Packed weights (kernels/cpu_qdot.py packs them at load; the GGUF bytes, none added, moved):
 * rows go in groups of 16 (N padded with zero rows), and a group's blocks along K are "units"
 * (one 32-block of a legacy type, one 256-block of a K-quant). A unit of 16 rows is its GGUF
 * fields one after another, each field of the 16 rows side by side:
 *   field of e-byte elements, F bytes a row -> [F/e][16 rows][e]
 *   e = 4 for codes (qs, ql, qh, hmask): vector p (64 bytes) = bytes 4p..4p+3 of each row
 *   e = 2 for fp16 scales (d, dmin, m): 16 halves;  e = 1 for scale bytes: planes [F][16]
 * so one 64-byte vector of codes holds 4 consecutive weights of each of the 16 rows.
 * Q6_K's code vectors then go in the order its decode row reads them (Q6K_QL, Q6K_QH below).
 *
 * Tile (what a unit unpacks into, per thread, in L1):
 *   codes uint8 [QB/4 chunks][16 rows][4]   chunk c = weights 4c..4c+3 of each row (unsigned
 *                                           0..63; Q8_0: signed, or + 128 where VNNI reads it;
 *                                           IQ4_NL, IQ4_XS: the codebook's int8 values, the
 *                                           same; MXFP4: its values + 12, cpu_qcodebook.c)
 *   K-quants (QB = 256): sc int32 [nsub][16] sub-block scales; mn int16 [8][16 rows][2]: the
 *     pair (M_2j, M_2j+1) of per-16 offsets; dk, dm float [16]. For row r and activations y
 *     (int8, one float scale dy a 256-block, sums bsum per 16):
 *       dot = dy * (dk[r] * sum_s sc[s][r] * (codes . y)_s  +  dm[r] * sum_j M_j[r] * bsum_j)
 *   legacy (QB = 32): d, m float [16]; with the type's integer offset `off`:
 *       dot = dy * (d[r] * ((codes . y) + off * ysum)  +  m[r] * ysum)
 */
#ifndef HETERO_CPU_QTYPES_H
#define HETERO_CPU_QTYPES_H
#include <stdint.h>

#define QR 16 /* rows per group */
#define KTILE_CODES 4096
#define KTILE_SC (KTILE_CODES)
#define KTILE_MN (KTILE_SC + 16 * QR * 4)
#define KTILE_DK (KTILE_MN + 8 * QR * 2 * 2)
#define KTILE_DM (KTILE_DK + QR * 4)
#define KTILE_BYTES (KTILE_DM + QR * 4)
#define LTILE_CODES 512
#define LTILE_D (LTILE_CODES)
#define LTILE_M (LTILE_D + QR * 4)
#define LTILE_BYTES (LTILE_M + QR * 4)

enum qkind { QK_LEGACY, QK_KQUANT };

typedef void (*unpack_fn)(const uint8_t *unit, uint8_t *tile);

typedef struct {
    int ggml_type;  /* GGMLQuantizationType value */
    int kind;       /* enum qkind */
    int qb;         /* weights a unit */
    int unit_bytes; /* bytes of a unit of 16 rows */
    int nsub;       /* K-quants: sub-blocks with their own scale (8 of 32, 16 of 16) */
    int flush;      /* chunks whose u8 x s8 pair sums int16 holds: 32767 / (2 * 127 * max code) */
    int off;        /* legacy: integer offset of the codes (Q4_0: -8) */
    int has_m;      /* legacy: a float offset m per block (Q4_1, Q5_1) */
    int is_signed;  /* codes are int8 (Q8_0, IQ4_NL, IQ4_XS where the dot takes signed codes) */
    unpack_fn unpack;
} qtype;

/* Q6_K's code vectors (after its 288-byte head: d, then the int8 scales' 16 planes) in the order
 * the decode row reads them, one forward stream (kernels/cpu_qdot.py packs them so): per half h,
 * for q = 0 .. 7 the ql vector of chunks 32h + q (low nibbles) and 32h + 16 + q (high nibbles)
 * beside the qh vector of chunks 32h + 8k + q (crumb k), then the 8 ql vectors of chunks
 * 32h + 8 + q and 32h + 24 + q. Q6K_QL(h, kk, q): the ql vector of chunk 32h + 8kk + q (kk 0,
 * 1; its high nibbles chunk + 16); Q6K_QH(h, q): the qh vector. */
#define Q6K_QL(h, kk, q) (288 + 64 * (24 * (h) + ((kk) ? 16 + (q) : 2 * (q))))
#define Q6K_QH(h, q) (288 + 64 * (24 * (h) + 2 * (q) + 1))

const qtype *qtype_of(int ggml_type);
/* Q4_K's and Q5_K's unit head (d, dmin, the 6-bit scales and mins) into a tile's sc, mn, dk and
 * dm, its codes left alone: what the single-row product reads beside the packed codes */
void k4_head(const uint8_t *u, uint8_t *t);
void q6k_head(const uint8_t *u, uint8_t *t); /* Q6_K's: d and the int8 scales, as above */
float half_to_float32(uint16_t h);
#endif
