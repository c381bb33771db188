"""The orthogonalisation cascade of ANVIL: six quintic maps that push a matrix's singular values to about 1.

For a matrix X = U S V^T (its singular value decomposition), the odd polynomial
p(X) = a X + b (X X^T) X + c (X X^T)^2 X equals U p(S) V^T, so a cascade of such maps acts on every singular
value separately, as the scalar map s -> a s + b s^3 + c s^5 composed six times. After the input is
normalised so that every singular value lies in (0, 1/margin], the composed map sends [0.003, 1/1.05] into
[0.995, 1.0004] (tests/optim/test_polar_express.py checks this on the coefficients themselves); bf16 matmuls
widen that band to about 0.5% either side (the same tests, at the track-1 bank shapes).

Each round is written with the smaller Gram matrix: for a tall X (rows > cols) A = X^T X and
X <- a X + X (b A + c A^2); otherwise A = X X^T and X <- a X + (b A + c A^2) X. The normalisation is free: the
first Gram is taken on the raw input and its trace is ||X||_F^2 >= s_max^2, so dividing X by
d = margin * sqrt(trace) * BF16_HEADROOM + eps (and A by d^2) bounds every singular value by 1/margin, bf16
rounding included, without a separate norm pass. Matmuls run in bf16 with fp32 accumulation; the scaling
runs in fp32, rounded once to bf16. ``gram`` picks how a round's products run: "bmm" (torch's bmm/baddbmm,
the reference: the application a X + X B is a torch.baddbmm), "squared" or "gram_space" (below).

"squared" takes out the passes over the large and the small matrix that are not matmuls. A baddbmm's output
starts as a copy of its input (torch copies it into the result before cuBLAS adds the product), and the
first round also divides X by d. Both fold into the small [s, s] factor: a X + X B = X (a I + B), and the
first round's (X / d) (a I + B) = X ((a I + B) / d); at the MLP bank's 24 x 2816 x 768 each fold saves a read
and a write of its 104 MB. The polynomial's own baddbmm copies A the same way; completing the square,
a I + b A + c A^2 = c ((A + delta I)^2 + gamma I) with delta = b / 2c and gamma = a / c - delta^2, so a round
is the Gram, a diagonal add, one bmm of the shifted Gram with itself, a second diagonal add and one plain bmm
of X. The factor c is not applied: X is carried as a scalar multiple lambda_k X_k of the reference's X_k, and
a round that leaves out c maps lambda_k X_k to lambda_k^5 / c_k X_{k+1}, which is lambda_{k+1} X_{k+1} with
the coefficients rescaled by powers of lambda_k (``_squared_rounds``). The first round's scale pass (the
normalisation, already there) sets lambda_1, chosen so that lambda_5 = 1: the last round is the reference's
own baddbmms on the reference's scale, and no lambda strays far from 1 (1.03, 1.16, 1.07, 0.99). The last
round stays unfolded: there a I + B would round to bf16 a second time, and once X has converged every
diagonal entry of that factor is the same number, so the roundings do not average out (folded, the last
round alone scaled every singular value by about 0.9944; the reference's median is 1.000). In the earlier
rounds the later maps absorb such errors: the spectrum stays in the reference's band, and the output is
within the bound two routes that round differently are held to (tests/optim/test_polar_express.py). The
maps' c must be positive (they are).

"gram_space" runs the rounds on the small Gram matrix itself (Gram Newton-Schulz: Zhang, Amsel, Chen and
Dao, 2026). With F_k = a I + b R_k + c R_k^2 (wide case; the tall one is its transpose), the next round's Gram
is R_{k+1} = F_k R_k F_k and the rounds' product Q = F_k ... F_j is applied to X once, so a round costs
[s, s] products only, not a Gram and an application of the large matrix. Q is as ill-conditioned as the
singular values it lifts, so X is formed again and its Gram taken afresh every two rounds
(``GRAM_SPACE_SEGMENTS``: three segments of two rounds; measured with heavy-tailed spectra, singular values
k^-1, one segment of six rounds or two of three left the band: 0.985 to 1.019). The rounds' [s, s] matrices
are fp16 (2^-11 rounding; each segment's Gram itself comes out of a bf16 bmm, rounded to bf16 first): the
products of a segment compound their rounding, and in bf16 the band widened to about 0.991 to 1.010 where
fp16 keeps 0.995 to 1.005 (the bank shapes on the CPU, random and heavy-tailed inputs). The normalisation
divides the first Gram into fp16 (a raw Gram can overflow it) and each segment's Q is divided into bf16,
folding in the normalisation and the factor c of the segment's last round, which is formed squared as in
"squared" (the rounds before it need R_k afterwards and use the reference's baddbmm on [s, s]). Squaring the
whole cascade's last round is safe here, unlike in "squared": the last segment's Q is a product of two
rounds, not a multiple of I plus a small matrix, so its single rounding to bf16 does not fall the same way on
every diagonal entry (the median singular value stays within the 0.2% the routes are held to). A segment
of two rounds takes one Gram and one application of the large matrix where "squared" takes two of each,
and three more products of [s, s] ones: a gain only where the long side is a few times s (``route_for``; on
an H100, the whole cascade in a CUDA graph against "squared": the MLP bank's 24 x 2816 x 768 2037 -> 1710
us, the qk bank's 48 x 256 x 768 279 -> 278 us, the vo bank's 16 x 768 x 768 560 -> 706 us;
perf/RESULTS.md, "Cascade products"). Not bitwise any other route, it is held to the same bounds as
"squared" (tests/optim/test_polar_express.py).

Provenance: the maps and the trace trick are those of the upstream record "#360 (ANVIL2)"
(``ANVIL_MAPS``, ``FROBENIUS_MARGIN``, ``FROBENIUS_EPS`` in modded-nanogpt's
``track_1_short/optim/anvil.py``), a successor of the Polar Express cascade (Amsel et al., 2025) used by
Muon/NorMuon. Upstream computes the Gram matrices with symmetric Triton kernels (half the FLOPs); here such
kernels measured slower than bmm (perf/RESULTS.md, "Superseded").
"""

from __future__ import annotations

import math

import torch

ANVIL_MAPS: tuple[tuple[float, float, float], ...] = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)
"""(a, b, c) of each quintic round, in order; derived upstream for inputs normalised by a margin of 1.05.

These are facts of the algorithm rather than settings: they only work as a set, for that margin."""

FROBENIUS_EPS = 1e-6
"""Added to the normaliser so that an all-zero matrix (a pad or frozen matrix) maps to zero, not NaN."""

BF16_HEADROOM = 1.0 + 2.0**-7
"""Extra factor on the normaliser (a deliberate difference from upstream's ``1.05 * sqrt(trace)``).

The composed maps stay near 1 only up to 1.0000163 / 1.05 and blow up just above it (1e40 at 0.955), so for a
rank-1 input, whose one singular value equals ||X||_F, rounding alone pushes it over: the trace is read from
the bf16 Gram's diagonal (each entry up to 2^-8 low) and X / d is stored in bf16 (||X||_2 up to 2^-8 high).
Measured: half of random rank-1 bf16 matrices left the band, some at 24. This factor covers both roundings
(together at most (1 + 2^-8)(1 + 2^-9) / 1.0000163 < 1 + 2^-7); it lowers every normalised singular value by
0.8%, inside the flat part of the maps."""


GRAMS = ("bmm", "squared", "gram_space")
"""The values of ``orthogonalize``'s ``gram`` (``OptimConfig.cascade_gram``)."""

GRAM_SPACE_SEGMENTS = (0, 2, 4)
"""The rounds at which the "gram_space" route forms X and takes its Gram afresh (the first is the input's)."""

GRAM_SPACE_MIN_ASPECT = 3.5
"""``route_for`` sends a bank to "gram_space" only where its matrices' long side is at least this many times
the short one. Measured on an H100 (perf/results/cascade_products.json): faster at 768 x 2816 (3.67), no
faster at 256 x 768 (3.0), slower at 768 x 768 (1.0): perf/RESULTS.md, "Cascade products"."""


def route_for(gram: str, rows: int, cols: int) -> str:
    """The route ``OptimConfig.cascade_gram`` gives a bank of [rows, cols] matrices: "gram_space" only where
    it measured faster (see ``GRAM_SPACE_MIN_ASPECT``), "squared" elsewhere; any other value as it is."""
    if gram == "gram_space" and max(rows, cols) < GRAM_SPACE_MIN_ASPECT * min(rows, cols):
        return "squared"
    return gram


def _segments() -> list[tuple[int, int]]:
    """[start, stop) of each "gram_space" segment, from ``GRAM_SPACE_SEGMENTS``, checked."""
    starts = tuple(GRAM_SPACE_SEGMENTS)
    n = len(ANVIL_MAPS)
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
        raise ValueError(
            f"GRAM_SPACE_SEGMENTS={starts} must start at 0 and increase strictly below {n} (the rounds)."
        )
    return list(zip(starts, (*starts[1:], n)))


def _squared_rounds(maps: tuple[tuple[float, float, float], ...]) -> tuple[list[tuple[float, float]], float]:
    """The "squared" route's constants: (delta_k, gamma_k) for each round but the last, and the first round's
    extra factor lambda_1 c_0 (see the module docstring), in double precision.

    Round k maps lambda_k X_k, with Gram lambda_k^2 A_k, to lambda_k X_k ((lambda_k^2 A_k + delta_k)^2 +
    gamma_k), which equals lambda_{k+1} X_{k+1} for lambda_{k+1} = lambda_k^5 / c_k; the first round (lambda_0
    = 1, the normalised Gram) also multiplies its factor by lambda_1 c_0. log lambda_1 = sum over k = 1 .. n-2
    of log(c_k) / 5^k puts lambda_{n-1} at 1.
    """
    if any(not c > 0 for _, _, c in maps):
        raise ValueError(f"the squared cascade needs every map's c > 0, got {[c for _, _, c in maps]}")
    n = len(maps)
    lam = [1.0, math.exp(sum(math.log(maps[k][2]) / 5**k for k in range(1, n - 1)))]
    for k in range(1, n - 1):
        lam.append(lam[k] ** 5 / maps[k][2])
    assert abs(lam[-1] - 1.0) < 1e-9, lam  # the last round runs on the reference's scale
    rounds = []
    for k, (a, b, c) in enumerate(maps[:-1]):
        delta = b * lam[k] ** 2 / (2 * c)
        rounds.append((delta, a * lam[k] ** 4 / c - delta**2))
    return rounds, lam[1] * maps[0][2]


_SQUARED_ROUNDS, _SQUARED_FIRST_FACTOR = _squared_rounds(ANVIL_MAPS)


def _gram(x: torch.Tensor, tall: bool) -> torch.Tensor:
    # [B, s, s] with s = min(rows, cols): the cheaper of X^T X and X X^T.
    return torch.bmm(x.mT, x) if tall else torch.bmm(x, x.mT)


def _poly(gram_matrix: torch.Tensor, b: float, c: float) -> torch.Tensor:
    # b A + c A A, [B, s, s]
    return torch.baddbmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)


def _squared_poly(big_a: torch.Tensor, delta: float, gamma: float) -> torch.Tensor:
    # (A + delta I)^2 + gamma I, [B, s, s]; shifts the Gram in place (a fresh tensor the caller gives up).
    big_a.diagonal(dim1=-2, dim2=-1).add_(delta)
    poly = torch.bmm(big_a, big_a)
    poly.diagonal(dim1=-2, dim2=-1).add_(gamma)
    return poly


def _apply(x: torch.Tensor, factor: torch.Tensor, tall: bool) -> torch.Tensor:
    # X F (tall) or F X (wide): a squared round's application, one plain bmm.
    return torch.bmm(x, factor) if tall else torch.bmm(factor, x)


def _apply_linear(x: torch.Tensor, poly: torch.Tensor, a: float, tall: bool) -> torch.Tensor:
    # a X + X B (tall) or a X + B X (wide): the reference's application, a baddbmm (its input copied first).
    return torch.baddbmm(x, x, poly, beta=a) if tall else torch.baddbmm(x, poly, x, beta=a)


def scaled(t: torch.Tensor, divisor: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``t`` (bf16 or fp16) divided by fp32 ``divisor`` (broadcast), in fp32 and rounded once to ``dtype``:
    the bits of ``(t.float() / divisor).to(dtype)`` in one pass that reads and writes 16-bit values.

    The spelled-out form runs three kernels and writes two fp32 copies of ``t``: for the MLP bank's 52M
    elements, about 1 GB of memory traffic where this moves 0.2 GB. The division's inputs are promoted to
    fp32 inside the kernel and the result is rounded on its store (tests/optim/test_polar_express.py checks
    the bits against the spelled-out form). On CUDA, outside torch.compile, a contiguous [B, rows, cols] with
    an fp32 [B, 1, 1] divisor goes through :mod:`track_1_short.perf.kernels.bf16_div` instead: the same bits
    (tests/perf/test_bf16_div.py) at about the copy rate, where torch's mixed-dtype broadcast division runs at
    a quarter of it."""
    out = torch.empty_like(t, dtype=dtype)
    if t.is_cuda and not torch.compiler.is_compiling():
        from track_1_short.perf.kernels import bf16_div  # Triton is imported only for CUDA tensors

        if dtype in bf16_div.DTYPES and bf16_div.supports(t, divisor):
            return bf16_div.launch_(t, divisor, out)  # out: a contiguous empty_like of a contiguous t
    return torch.div(t, divisor, out=out)


def scaled_to_bf16(t: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """:func:`scaled` to bf16: the cascade's normalisation."""
    return scaled(t, divisor, torch.bfloat16)


def _gram_space(x: torch.Tensor, margin: float, tall: bool) -> torch.Tensor:
    # The "gram_space" route (module docstring): per segment, the Gram of X (bf16) in fp16, the segment's
    # rounds on it, and X formed again from the rounds' product Q, divided into bf16.
    norm = None
    for start, stop in _segments():
        gram = _gram(x, tall)
        first = norm is None
        if first:
            norm = _normaliser(gram, margin)
            r = scaled(gram, norm.square(), torch.float16)
        else:  # divided by 1, which is exact: the same kernel as every other change of precision here
            r = scaled(gram, torch.ones_like(norm), torch.float16)
        q = None
        for k in range(start, stop):
            a, b, c = ANVIL_MAPS[k]
            if k + 1 < stop:  # R_k is needed for R_{k+1}: the reference's polynomial, which copies R_k
                factor = _poly(r, b, c)
                factor.diagonal(dim1=-2, dim2=-1).add_(a)
                r = torch.bmm(factor, torch.bmm(factor, r))  # F R F, F a polynomial in R
            else:  # F / c as the squared route forms it; c goes into the division below
                delta = b / (2 * c)
                factor = _squared_poly(r, delta, a / c - delta**2)
            q = factor if q is None else torch.bmm(factor, q)
        last_c = ANVIL_MAPS[stop - 1][2]
        divisor = norm / last_c if first else torch.full_like(norm, 1 / last_c)
        q = scaled(q, divisor, x.dtype)
        x = torch.bmm(x, q.mT) if tall else torch.bmm(q, x)  # X^T <- Q X^T for a tall X
    return x


def _normaliser(gram: torch.Tensor, margin: float) -> torch.Tensor:
    # margin * ||X||_F * BF16_HEADROOM + eps, [B, 1, 1] fp32, from the bf16 Gram's diagonal (its trace is
    # ||X||_F^2).
    trace = gram.diagonal(dim1=-2, dim2=-1).float().sum(-1).view(-1, 1, 1)
    return trace.sqrt().mul_(margin * BF16_HEADROOM).add_(FROBENIUS_EPS)


def orthogonalize(x: torch.Tensor, margin: float = 1.05, gram: str = "bmm") -> torch.Tensor:
    """Map each matrix of a bf16 batch [B, rows, cols] to one with singular values close to 1 (bf16, same
    shape).

    ``margin`` (> 1) scales the Frobenius-norm bound; the maps are derived for 1.05. ``gram``: one of
    :data:`GRAMS` (see the module docstring). The input is not modified.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"orthogonalize: expected a batch of matrices [B, rows, cols], got {shape}.")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"orthogonalize: expected a bf16 tensor, got {x.dtype}; cast it with .bfloat16().")
    if not margin > 1.0:
        raise ValueError(f"orthogonalize: margin={margin} must be > 1 (the maps diverge above 1/margin).")
    if gram not in GRAMS:
        raise ValueError(f"orthogonalize: gram={gram!r} must be one of {list(GRAMS)}.")
    tall = x.size(-2) > x.size(-1)
    if gram == "gram_space":
        return _gram_space(x, margin, tall)
    big_a = _gram(x, tall)
    norm = _normaliser(big_a, margin)
    big_a = scaled_to_bf16(big_a, norm.square())
    squared = gram == "squared"
    if not squared:
        x = scaled_to_bf16(x, norm)
    for i, (a, b, c) in enumerate(ANVIL_MAPS):
        if i > 0:
            big_a = _gram(x, tall)
        last = i == len(ANVIL_MAPS) - 1  # never folded: see the module docstring
        if squared and not last:
            poly = _squared_poly(big_a, *_SQUARED_ROUNDS[i])  # the Gram is fresh, not needed after this
            if i == 0:  # the normalisation of X, carried by the small factor
                poly = scaled_to_bf16(poly, norm / _SQUARED_FIRST_FACTOR)
            x = _apply(x, poly, tall)
        else:
            x = _apply_linear(x, _poly(big_a, b, c), a, tall)
    return x


def cascade_flops(batch: int, rows: int, cols: int, gram: str = "bmm") -> int:
    """Matmul FLOPs (2 per multiply-add) of :func:`orthogonalize` on [batch, rows, cols] with ``gram``, as
    plain matmuls.

    With s = min(rows, cols) and l = max(rows, cols), per round and matrix of every route but "gram_space":
    the Gram 2 l s^2, A A 2 s^3 and the application 2 l s^2. "gram_space", per segment: the Gram and the
    application (2 l s^2 each), and 2 s^3 for each [s, s] product: the polynomial (A A) of every round,
    F (F R) in every round but the segment's last, and F Q in every round but its first.
    """
    s, long = min(rows, cols), max(rows, cols)
    if gram not in GRAMS:
        raise ValueError(f"cascade_flops: gram={gram!r} must be one of {list(GRAMS)}.")
    if gram == "gram_space":
        total = 0
        for start, stop in _segments():
            rounds = stop - start
            total += 2 * (2 * long * s * s) + (rounds + 2 * (rounds - 1) + (rounds - 1)) * 2 * s**3
        return batch * total
    per_round = 2 * long * s * s + 2 * s**3 + 2 * long * s * s
    return batch * len(ANVIL_MAPS) * per_round
