"""Scale searches of llama.cpp's reference K-quantizers, vectorized over sub-blocks in numpy.

Each function takes `x` of shape (m, n): m independent sub-blocks of n values (16 or 32), and does
for all of them at once what ggml-quants.c does for one (`make_qkx2_quants`, `make_qx_quants`,
`make_q3_quants` with the same candidate grids, weights and acceptance tests). Loops run over
candidates or element positions, never over sub-blocks. Levels are kept as float32 (exact small
integers) so the weighted sums are plain dot products.

Rounding is `np.rint` (half to even), which is what ggml's `nearest_int` float trick computes.
"""

from __future__ import annotations

import numpy as np

GROUP_MAX_EPS = np.float32(1e-15)
_F32 = np.float32


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot product: (m, n), (m, n) -> (m,)."""
    return np.einsum("ij,ij->i", a, b)


def _levels(x: np.ndarray, iscale: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """clip(round(iscale * x), lo, hi) as float32; x (m, n), iscale (m,)."""
    l = x * iscale[:, None]
    np.rint(l, out=l)
    return np.clip(l, lo, hi, out=l)


def _signed_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the value of largest magnitude (first one on ties) and that magnitude."""
    ax = np.abs(x)
    idx = ax.argmax(axis=1)
    rows = np.arange(x.shape[0])
    return x[rows, idx], ax[rows, idx]


class _AffineFit:
    """Buffers and per-row sums of one make_qkx2_quants call over x, w of shape (m, n)."""

    def __init__(self, x: np.ndarray, w: np.ndarray, nmax: int, use_mad: bool) -> None:
        self.x, self.w, self.nmax, self.use_mad = x, w, nmax, use_mad
        self.wx = w * x
        self.sum_w, self.sum_x = w.sum(axis=1), self.wx.sum(axis=1)
        self.levels = np.empty_like(x)  # the candidate grid's levels, rewritten per candidate
        self.tmp = np.empty_like(x)

    def round(self, the_min: np.ndarray, iscale: np.ndarray) -> np.ndarray:
        """Levels clip(round(iscale * (x - min)), 0, nmax) into the shared buffer."""
        l = np.subtract(self.x, the_min[:, None], out=self.levels)
        l *= iscale[:, None]
        np.rint(l, out=l)
        return np.clip(l, 0, self.nmax, out=l)

    def sums(self, l: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sum w l, sum w l^2, sum w x l) per row."""
        wl = np.multiply(self.w, l, out=self.tmp)
        return _dot(self.w, l), _dot(wl, l), _dot(self.wx, l)

    def error(self, l: np.ndarray, s: np.ndarray, m: np.ndarray, sums) -> np.ndarray:
        """Weighted error of dequantizing l as s*l + m: sum w |.| (Q2_K) or sum w (.)^2.

        The squared error is expanded into the sums already at hand, up to the constant
        sum w x^2 (three dot products instead of five elementwise passes); float64 keeps the
        cancellation harmless.
        """
        if self.use_mad:
            diff = np.multiply(l, s[:, None], out=self.tmp)
            diff += m[:, None]
            diff -= self.x
            return _dot(np.abs(diff, out=diff), self.w)
        sum_l, sum_l2, sum_xl = (v.astype(np.float64) for v in sums)
        s64, m64 = s.astype(np.float64), m.astype(np.float64)
        sum_w, sum_x = self.sum_w.astype(np.float64), self.sum_x.astype(np.float64)
        return (
            s64 * s64 * sum_l2
            + 2 * s64 * m64 * sum_l
            + m64 * m64 * sum_w
            - 2 * s64 * sum_xl
            - 2 * m64 * sum_x
        )

    def least_squares(self, sums) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Weighted least-squares (scale, min) for the levels, min clamped to <= 0; and det."""
        sum_l, sum_l2, sum_xl = sums
        sum_w, sum_x = self.sum_w, self.sum_x
        det = sum_w * sum_l2 - sum_l * sum_l
        s = (sum_w * sum_xl - sum_x * sum_l) / det
        m = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamp = m > 0  # a positive min is not representable: refit the scale alone
        return np.where(clamp, sum_xl / sum_l2, s), np.where(clamp, _F32(0), m), det


def make_qkx2_quants(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine (scale, min) fit of x (m, n) to levels 0..nmax under weights w (m, n).

    Tries the plain min/max grid, then nstep + 1 stretched grids (rmin + rdelta*i + nmax levels
    over [min, max]), each with its weighted least-squares scale and min, keeping the best by
    weighted squared (or absolute) error. As in ggml, `min` is the best fit's min so far, so later
    grids start from it. Returns (levels (m, n) uint8, scale (m,), -min (m,)).
    """
    fit = _AffineFit(x, w, nmax, use_mad)
    mn, mx = np.minimum(x.min(axis=1), _F32(0)), x.max(axis=1)
    flat = mx == mn  # constant non-positive rows: all levels 0, dequantized as the min
    iscale = _F32(nmax) / np.where(flat, _F32(1), mx - mn)
    best_l = fit.round(mn, iscale).copy()
    scale, the_min = _F32(1) / iscale, mn
    best = fit.error(best_l, scale, the_min, fit.sums(best_l))
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            grid = _F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)
            l = fit.round(the_min, grid / (mx - the_min))
            sums = fit.sums(l)
            s, m, det = fit.least_squares(sums)
            err = fit.error(l, s, m, sums)
            better = (det > 0) & (err < best)
            np.copyto(best_l, l, where=better[:, None])
            best = np.where(better, err, best)
            scale = np.where(better, s, scale)
            the_min = np.where(better, m, the_min)
    best_l[flat] = 0
    scale = np.where(flat, _F32(0), scale).astype(np.float32)
    return best_l.astype(np.uint8), scale, (-the_min).astype(np.float32)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric fit of x (m, n) to levels -nmax..nmax-1 weighted by x^2 (rmse_type 1).

    Tries 19 grids (nmax + 0.1*i levels on the largest magnitude, i in -9..9) and keeps the one
    maximising (sum w x l)^2 / sum w l^2, i.e. least weighted squared error at its optimal scale.
    Returns (levels + nmax as uint8 (m, n), scale (m,)); all-zero rows get scale 0.
    """
    w = x * x
    wx = w * x
    vmax, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    vmax = np.where(zero, _F32(1), vmax)

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        l = _levels(x, iscale, -nmax, nmax - 1)
        return _dot(wx, l), _dot(w * l, l)

    best_iscale = _F32(-nmax) / vmax
    sumlx, suml2 = fit(best_iscale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            iscale = -(_F32(nmax) + _F32(0.1) * _F32(step)) / vmax
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
            best_iscale = np.where(better, iscale, best_iscale)
    levels = _levels(x, best_iscale, -nmax, nmax - 1) + nmax
    levels[zero] = 0
    return levels.astype(np.uint8), np.where(zero, _F32(0), scale).astype(np.float32)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric fit to -nmax..nmax-1 weighted by x^2, refined by coordinate descent (do_rmse).

    Starting from the grid on the largest magnitude, each element in turn moves to the level that
    is optimal for the scale the other elements imply, if that lowers the error; up to 5 passes.
    The passes run over element positions, vectorized across sub-blocks (a row whose pass changed
    nothing is at a fixed point, so extra passes leave it as it is).
    Returns (levels + nmax as uint8 (m, n), scale (m,)).
    """
    vmax, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    iscale = _F32(-nmax) / np.where(zero, _F32(1), vmax)
    levels = _levels(x, iscale, -nmax, nmax - 1)
    w = x * x
    sumlx, suml2 = _dot(w * x, levels), _dot(w * levels, levels)
    # element-major copies: column i of every row is then one contiguous vector
    xt, wt, lt = x.T.copy(), w.T.copy(), levels.T.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):
            changed = False
            for i in range(x.shape[1]):
                sumlx, suml2, moved = _q3_move(xt[i], wt[i], lt[i], sumlx, suml2, nmax)
                changed = changed or moved
            if not changed:
                break
        scale = np.where(suml2 > 0, sumlx / suml2, _F32(0))
    levels = lt.T + nmax
    levels[zero] = 0
    return levels.astype(np.uint8), np.where(zero, _F32(0), scale).astype(np.float32)


def _q3_move(
    xi: np.ndarray,
    wi: np.ndarray,
    li: np.ndarray,
    sumlx: np.ndarray,
    suml2: np.ndarray,
    nmax: int,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """One coordinate step of make_q3_quants at element i of every row; updates li in place."""
    wxi = wi * xi
    slx = sumlx - wxi * li
    sl2 = suml2 - wi * li * li
    new_l = np.clip(np.rint(xi * sl2 / slx), -nmax, nmax - 1)
    slx_new = slx + wxi * new_l
    sl2_new = sl2 + wi * new_l * new_l
    accept = (
        (slx > 0)
        & (new_l != li)
        & (sl2_new > 0)
        & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
    )
    if not accept.any():
        return sumlx, suml2, False
    np.copyto(li, new_l, where=accept)
    return np.where(accept, slx_new, sumlx), np.where(accept, sl2_new, suml2), True
