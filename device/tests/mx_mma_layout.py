# CPU emulation of the tensor-core MXFP4 consumers' fragment layouts (the weights as A, rows.cuh)
# against a direct product: the staged B fragments, the A words, the register mappings of the PTX
# ISA, the kept part of the result and its scale. First mx_rows_pages_hmma (fp16 m16n8k16, two row
# tiles a block: two parts a token at batch 3 and 4, run here at 1 to 4; one part at batch 5 to 8,
# run at 3, 5 and 8), then mx_rows_pages_mma (int8 m16n8k32 with prmt's lookup, batch 1 and 2).
# Needs numpy. python3 device/tests/mx_mma_layout.py
import numpy as np
rng = np.random.default_rng(0)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
def e2m1(c): return (-1 if c & 8 else 1) * E2M1[c & 7]
def half2(c):  # e2m1x8_half2: returns 4 pairs (lo, hi) as float values (x 2^-14)
    out = []
    for i in range(4):
        q = (c << (12 - 4 * i)) & 0xffffffff
        h = (q & 0x80008000) | ((q >> 3) & 0x0E000E00)
        lo = np.array([h & 0xffff], np.uint16).view(np.float16)[0]
        hi = np.array([h >> 16], np.uint16).view(np.float16)[0]
        out.append((np.float32(lo), np.float32(hi)))
    return out
def case(B, k, rows=8):  # random codes and scales of a page's rows, x [B, k], and x W^T in fp64
    codes = rng.integers(0, 256, size=(rows, k // 2), dtype=np.int64)
    sc = rng.integers(120, 135, size=(rows, k // 32))
    W = np.zeros((rows, k))
    for j in range(rows):
        for e in range(k):
            c = (codes[j, e // 2] >> (4 * (e % 2))) & 15
            W[j, e] = e2m1(c) * 2.0 ** (sc[j, e // 32] - 127)
    x = rng.standard_normal((B, k)).astype(np.float32)
    return rows, codes, sc, x, x.astype(np.float64) @ W.T
def mma(A, Bm, C):  # A: 16x16, Bm: 16x8
    return C + A.astype(np.float64) @ Bm.astype(np.float64)
for parts, batches in ((2, (1, 2, 3, 4)), (1, (3, 5, 8))):
 # parts 2: a column is a token's fp16 high or low part (batch 3 and 4); parts 1: a token's one fp16
 # part (batch 5 to 8, where two parts' fragments outgrow shared memory). A's rows g and g + 8 are
 # row g of two tiles (8 rows each) at the same 32-element block.
 for B in batches:
  for k in (64, 96, 3584):
    rows, codes, sc, x, ref = case(B, k, 16)
    # staging: block q's fragments, lane (g, t): column g, elements 8t..8t+7 of the block
    scale = [2.0 ** (14 - (np.frexp(np.abs(x[b]).max())[1])) for b in range(B)]
    frags = {}
    for q in range(k // 32):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            b, l = (g // 2, g % 2) if parts == 2 else (g, 0)
            if b >= B: continue
            v = []
            for u in range(8):
                val = np.float32(x[b, q * 32 + 8 * t + u] * scale[b])
                hi = np.float32(np.float16(val))
                v.append(hi if l == 0 else np.float32(np.float16(val - hi)))
            frags[(q, lane)] = [(v[0], v[4]), (v[1], v[5]), (v[2], v[6]), (v[3], v[7])]
    # consumer, one warp doing all blocks (the warp split only partitions q)
    acc = np.zeros((32, 2, 2))  # [lane][tile][column 2t, 2t + 1]
    def word(j, byte):  # 4 code bytes as a little-endian word
        bs = [codes[j, byte + i] for i in range(4)]
        return bs[0] | bs[1] << 8 | bs[2] << 16 | bs[3] << 24
    for q in range(k // 32):
        A = [np.zeros((16, 16)), np.zeros((16, 16))]; Bm = [np.zeros((16, 8)), np.zeros((16, 8))]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            lo = half2(word(g, 16 * q + 4 * t)); hi = half2(word(8 + g, 16 * q + 4 * t))
            regs = [(lo[0], hi[0], lo[1], hi[1]), (lo[2], hi[2], lo[3], hi[3])]
            f = frags.get((q, lane), [(0, 0)] * 4)
            bregs = [(f[0], f[1]), (f[2], f[3])]
            for m in range(2):
                a0, a1, a2, a3 = regs[m]
                A[m][g, 2 * t:2 * t + 2] = a0; A[m][g + 8, 2 * t:2 * t + 2] = a1
                A[m][g, 2 * t + 8:2 * t + 10] = a2; A[m][g + 8, 2 * t + 8:2 * t + 10] = a3
                b0, b1 = bregs[m]
                Bm[m][2 * t:2 * t + 2, g] = b0; Bm[m][2 * t + 8:2 * t + 10, g] = b1
        D = mma(A[1], Bm[1], mma(A[0], Bm[0], np.zeros((16, 8))))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for h in range(2):  # tile h's row g: D's row g + 8 h, times its block scale
                scv = 2.0 ** (sc[8 * h + g, q] - 127)
                acc[lane, h] += scv * D[g + 8 * h, 2 * t:2 * t + 2]
    out = np.zeros((B, rows))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            if parts == 2:  # token t: its high and low parts
                if t < B: out[t, 8 * h + g] = acc[lane, h].sum() * 16384 / scale[t]
            else:
                for i in range(2):
                    if 2 * t + i < B: out[2 * t + i, 8 * h + g] = acc[lane, h, i] * 16384 / scale[2 * t + i]
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"fp16 x {parts}: B={B} k={k}: max rel error {err:.2e}")
    assert err < (1e-5 if parts == 2 else 2e-3), err

# mx_rows_pages_mma: int8. prmt.b32 in its default mode: selector nibble n picks byte n & 7 of
# {a, b}; its top bit replicates that byte's sign bit instead.
def prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xff for i in range(4)] + [(b >> (8 * i)) & 0xff for i in range(4)]
    d = 0
    for n in range(4):
        q = (sel >> (4 * n)) & 0xf
        byte = src[q & 7]
        if q & 8:
            byte = 0xff if byte & 0x80 else 0
        d |= byte << (8 * n)
    return d
def s8x4(w): return [((w >> (8 * i)) & 0xff) - (256 if (w >> (8 * i)) & 0x80 else 0) for i in range(4)]
LO, HI = 0x03020100, 0x0C080604  # 2 e2m1 of the magnitudes 0..7
def e2m1x8_s8(c):
    n = c ^ 0x88888888
    return [prmt(LO, HI, c), prmt(LO, HI, c >> 16)], [prmt(LO, HI, n), prmt(LO, HI, n >> 16)]
f32 = np.float32
for B in (1, 2):
  for k in (64, 96, 3584):
    rows, codes, sc, x, ref = case(B, k, 16)
    scale = [f32(2.0 ** (7 - np.frexp(np.abs(x[b]).max())[1])) for b in range(B)]
    frags = {}
    for q in range(k // 32):  # stage_mx_frags: a thread per (block, token, t), its parts to 4 lanes
        for b in range(B):
            for t in range(4):
                r = [f32(x[b, q * 32 + 8 * t + u] * scale[b]) for u in range(8)]
                for j in range(4):
                    p, nq = [0, 0], [0, 0]
                    for u in range(8):
                        part = int(max(-127, min(127, np.rint(r[u]))))
                        r[u] = f32(f32(r[u] - f32(part)) * f32(128))
                        p[u // 4] |= (part & 0xff) << (8 * (u % 4))
                        nq[u // 4] |= (-part & 0xff) << (8 * (u % 4))
                    frags[(q, (4 * b + j) * 4 + t)] = (p[0], p[1], nq[0], nq[1])
    acc = np.zeros((32, 2))  # [lane][tile]
    def word(j, byte):
        bs = [codes[j, byte + i] for i in range(4)]
        return bs[0] | bs[1] << 8 | bs[2] << 16 | bs[3] << 24
    for q in range(k // 32):
        Ap, An = np.zeros((16, 32), np.int64), np.zeros((16, 32), np.int64)
        Bp, Bn = np.zeros((32, 8), np.int64), np.zeros((32, 8), np.int64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            pos0, neg0 = e2m1x8_s8(word(g, 16 * q + 4 * t))      # row g of the first tile
            pos1, neg1 = e2m1x8_s8(word(8 + g, 16 * q + 4 * t))  # of the second
            for A, r0, r1 in ((Ap, pos0, pos1), (An, neg0, neg1)):  # a0 a1 a2 a3 of m16n8k32
                A[g, 4 * t:4 * t + 4] = s8x4(r0[0]); A[g + 8, 4 * t:4 * t + 4] = s8x4(r1[0])
                A[g, 16 + 4 * t:20 + 4 * t] = s8x4(r0[1]); A[g + 8, 16 + 4 * t:20 + 4 * t] = s8x4(r1[1])
            f = frags.get((q, lane), (0, 0, 0, 0))
            Bp[4 * t:4 * t + 4, g] = s8x4(f[0]); Bp[16 + 4 * t:20 + 4 * t, g] = s8x4(f[1])
            Bn[4 * t:4 * t + 4, g] = s8x4(f[2]); Bn[16 + 4 * t:20 + 4 * t, g] = s8x4(f[3])
        D = Ap @ Bp + An @ Bn
        assert np.abs(D).max() < 2 ** 31
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for h in range(2):
                v = D[g + 8 * h, 2 * t] * 128 + D[g + 8 * h, 2 * t + 1]
                assert abs(v) < 2 ** 24  # exact in an fp32
                acc[lane, h] += 2.0 ** (sc[8 * h + g, q] - 127) * float(v)
    out = np.zeros((B, rows))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        unit = 1 / 128 if t % 2 == 0 else 1 / 128 ** 3
        if t // 2 < B:  # token t / 2, parts 2 (t % 2) and the next: lanes t and t ^ 1 add
            for h in range(2):
                out[t // 2, 8 * h + g] += acc[lane, h] * unit * 0.5 / scale[t // 2]
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"int8 B={B} k={k}: max rel error {err:.2e}")
    assert err < 1e-6, err
print("ok")
