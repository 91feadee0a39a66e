// Packed projection weights (``ops.pack_panels``) and how a pass fetches them.
//
// Skinny GEMM, y[M, N] = x[M, K] @ W (+ bias), for projections whose weights were packed once
// at load into column panels: panel p holds W[:, 32p : 32p + 32] as K rows of 32 values, so
// one panel is one sequential stream. Each thread takes a contiguous run of panels; inside a
// panel, rows go a few at a time into register accumulators (12 on AVX-512, 3 on AVX2), so a
// panel is read from memory once per step and from cache for every further pass. At decode
// sizes the weights' bytes bound the time and the panels stream at memory speed.
//
// A bf16 panel row (64 bytes) holds column c in its 16-bit slot 2c and column 16 + c in slot
// 2c + 1 (c < 16), so a 32-bit lane holds columns c and 16 + c: a shift and a mask widen both.
#pragma once

namespace {
constexpr int PANEL = 32;  // columns per panel
enum class Fetch { none, whole, spread };  // how a pass fetches the next panel (``k_loop``)
}  // namespace
