//! The prelude's helpers: the CUDA C each intrinsic (and the bf16/f16 types) needs, emitted
//! once per kernel that uses it.

/// Pieces of the emitted prelude. Only the ones a kernel uses are emitted, in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Helper {
    /// `struct bf16` (raw bits).
    Bf16Type,
    /// `struct f16` (raw bits).
    F16Type,
    /// `struct u32x4`.
    U32x4Type,
    /// bf16 <-> f32 conversion.
    Bf16Convert,
    /// f16 <-> f32 conversion.
    F16Convert,
    /// `pack_bf16x2`.
    PackBf16x2,
    /// `bf16_lo` / `bf16_hi`.
    UnpackBf16x2,
    /// `pack_f16x2`.
    PackF16x2,
    /// `f16_lo` / `f16_hi`.
    UnpackF16x2,
    /// Generic-to-shared address conversion.
    SmemAddr,
    /// mma bf16.
    MmaBf16,
    /// mma f16.
    MmaF16,
    /// ldmatrix variants.
    Ldmatrix,
    /// cp.async of 16 bytes.
    CpAsync,
    /// cp.async of 8 and 4 bytes (`.ca`: `.cg` takes only 16).
    CpAsyncSmall,
    /// cp.async commit and wait.
    CpAsyncGroup,
    /// lop3.
    Lop3,
    /// prmt.
    Prmt,
    /// fma.rn.bf16x2.
    FmaBf16x2,
    /// ex2.approx.ftz.f32.
    Exp2Approx,
    /// `griddepcontrol` wait and launch_dependents.
    GridDependency,
    /// Warpgroup MMA (`wgmma`): fences, groups and descriptors.
    Wgmma,
    /// `wgmma_bf16_ss`, one overload per N.
    WgmmaSs,
    /// `wgmma_bf16_rs`, one overload per N.
    WgmmaRs,
    /// `wgmma_bf16_rs_mn`.
    WgmmaRsMn,
    /// mbarrier init, arrive with expected bytes, wait.
    Mbarrier,
    /// `cp.async.bulk` global to shared, completing on an mbarrier.
    CpAsyncBulk,
}

impl Helper {
    /// Helpers this one needs.
    pub fn deps(self) -> &'static [Helper] {
        match self {
            Helper::Bf16Convert => &[Helper::Bf16Type],
            Helper::F16Convert => &[Helper::F16Type],
            Helper::Ldmatrix | Helper::CpAsync | Helper::CpAsyncSmall | Helper::Wgmma => &[Helper::SmemAddr],
            Helper::WgmmaSs | Helper::WgmmaRs | Helper::WgmmaRsMn => &[Helper::Wgmma],
            Helper::Mbarrier | Helper::CpAsyncBulk => &[Helper::SmemAddr],
            _ => &[],
        }
    }

    /// The CUDA C text.
    pub fn source(self) -> &'static str {
        match self {
            Helper::Bf16Type => "struct __align__(2) bf16 { unsigned short bits; };\n",
            Helper::F16Type => "struct __align__(2) f16 { unsigned short bits; };\n",
            Helper::U32x4Type => "struct __align__(16) u32x4 { unsigned int x, y, z, w; };\n",
            Helper::Bf16Convert => {
                "__device__ __forceinline__ float bf16_to_f32(bf16 h) { return __uint_as_float(((unsigned int)h.bits) << 16); }
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    bf16 h;
    asm(\"cvt.rn.bf16.f32 %0, %1;\" : \"=h\"(h.bits) : \"f\"(f));
    return h;
}
"
            }
            Helper::F16Convert => {
                "__device__ __forceinline__ float f16_to_f32(f16 h) {
    float f;
    asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(h.bits));
    return f;
}
__device__ __forceinline__ f16 f32_to_f16(float f) {
    f16 h;
    asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h.bits) : \"f\"(f));
    return h;
}
"
            }
            Helper::PackBf16x2 => {
                "__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    unsigned int r;
    asm(\"cvt.rn.bf16x2.f32 %0, %1, %2;\" : \"=r\"(r) : \"f\"(hi), \"f\"(lo));
    return r;
}
"
            }
            Helper::UnpackBf16x2 => {
                "__device__ __forceinline__ float bf16_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int v) { return __uint_as_float(v & 0xffff0000u); }
"
            }
            Helper::PackF16x2 => {
                "__device__ __forceinline__ unsigned int pack_f16x2(float lo, float hi) {
    unsigned int r;
    asm(\"cvt.rn.f16x2.f32 %0, %1, %2;\" : \"=r\"(r) : \"f\"(hi), \"f\"(lo));
    return r;
}
"
            }
            Helper::UnpackF16x2 => {
                "__device__ __forceinline__ float f16_lo(unsigned int v) {
    float f;
    asm(\"{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l; }\" : \"=f\"(f) : \"r\"(v));
    return f;
}
__device__ __forceinline__ float f16_hi(unsigned int v) {
    float f;
    asm(\"{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h; }\" : \"=f\"(f) : \"r\"(v));
    return f;
}
"
            }
            Helper::SmemAddr => {
                "__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return static_cast<unsigned int>(__cvta_generic_to_shared(p));
}
"
            }
            Helper::MmaBf16 => {
                "__device__ __forceinline__ void mma_m16n8k16_bf16(float* d, const unsigned int* a, const unsigned int* b) {
    asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\"
                 : \"+f\"(d[0]), \"+f\"(d[1]), \"+f\"(d[2]), \"+f\"(d[3])
                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));
}
"
            }
            Helper::MmaF16 => {
                "__device__ __forceinline__ void mma_m16n8k16_f16(float* d, const unsigned int* a, const unsigned int* b) {
    asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\"
                 : \"+f\"(d[0]), \"+f\"(d[1]), \"+f\"(d[2]), \"+f\"(d[3])
                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));
}
"
            }
            Helper::Ldmatrix => {
                "__device__ __forceinline__ void ldmatrix_x1(unsigned int* r, const void* p) {
    asm volatile(\"ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\" : \"=r\"(r[0]) : \"r\"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned int* r, const void* p) {
    asm volatile(\"ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\" : \"=r\"(r[0]), \"=r\"(r[1]) : \"r\"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const void* p) {
    asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\"
                 : \"=r\"(r[0]), \"=r\"(r[1]), \"=r\"(r[2]), \"=r\"(r[3]) : \"r\"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned int* r, const void* p) {
    asm volatile(\"ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\" : \"=r\"(r[0]), \"=r\"(r[1]) : \"r\"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const void* p) {
    asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\"
                 : \"=r\"(r[0]), \"=r\"(r[1]), \"=r\"(r[2]), \"=r\"(r[3]) : \"r\"(smem_addr(p)));
}
"
            }
            Helper::CpAsync => {
                "__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
    asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: \"r\"(smem_addr(dst)), \"l\"(src) : \"memory\");
}
__device__ __forceinline__ void cp_async_16_zfill(void* dst, const void* src, bool pred) {
    asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16, %2;\" :: \"r\"(smem_addr(dst)), \"l\"(src), \"r\"(pred ? 16 : 0) : \"memory\");
}
"
            }
            Helper::CpAsyncSmall => {
                "__device__ __forceinline__ void cp_async_8(void* dst, const void* src) {
    asm volatile(\"cp.async.ca.shared.global [%0], [%1], 8;\" :: \"r\"(smem_addr(dst)), \"l\"(src) : \"memory\");
}
__device__ __forceinline__ void cp_async_8_zfill(void* dst, const void* src, bool pred) {
    asm volatile(\"cp.async.ca.shared.global [%0], [%1], 8, %2;\" :: \"r\"(smem_addr(dst)), \"l\"(src), \"r\"(pred ? 8 : 0) : \"memory\");
}
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
    asm volatile(\"cp.async.ca.shared.global [%0], [%1], 4;\" :: \"r\"(smem_addr(dst)), \"l\"(src) : \"memory\");
}
__device__ __forceinline__ void cp_async_4_zfill(void* dst, const void* src, bool pred) {
    asm volatile(\"cp.async.ca.shared.global [%0], [%1], 4, %2;\" :: \"r\"(smem_addr(dst)), \"l\"(src), \"r\"(pred ? 4 : 0) : \"memory\");
}
"
            }
            Helper::CpAsyncGroup => {
                "__device__ __forceinline__ void cp_async_commit() { asm volatile(\"cp.async.commit_group;\" ::: \"memory\"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile(\"cp.async.wait_group %0;\" :: \"n\"(N) : \"memory\"); }
"
            }
            Helper::Lop3 => {
                "template <int LUT> __device__ __forceinline__ unsigned int lop3(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm(\"lop3.b32 %0, %1, %2, %3, %4;\" : \"=r\"(d) : \"r\"(a), \"r\"(b), \"r\"(c), \"n\"(LUT));
    return d;
}
"
            }
            Helper::Prmt => {
                "__device__ __forceinline__ unsigned int prmt(unsigned int a, unsigned int b, unsigned int s) {
    unsigned int d;
    asm(\"prmt.b32 %0, %1, %2, %3;\" : \"=r\"(d) : \"r\"(a), \"r\"(b), \"r\"(s));
    return d;
}
"
            }
            Helper::Exp2Approx => {
                "__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x));
    return y;
}
"
            }
            Helper::FmaBf16x2 => {
                "__device__ __forceinline__ unsigned int fma_bf16x2(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm(\"fma.rn.bf16x2 %0, %1, %2, %3;\" : \"=r\"(d) : \"r\"(a), \"r\"(b), \"r\"(c));
    return d;
}
"
            }
            Helper::Wgmma => wgmma_source(WgmmaShape::Base),
            Helper::WgmmaSs => wgmma_source(WgmmaShape::Ss),
            Helper::WgmmaRs => wgmma_source(WgmmaShape::Rs),
            Helper::WgmmaRsMn => wgmma_source(WgmmaShape::RsMn),
            Helper::Mbarrier => {
                "__device__ __forceinline__ void mbar_init(void* bar, unsigned int count) {
    asm volatile(\"mbarrier.init.shared::cta.b64 [%0], %1;\" :: \"r\"(smem_addr(bar)), \"r\"(count) : \"memory\");
    asm volatile(\"fence.mbarrier_init.release.cluster;\" ::: \"memory\");
}
__device__ __forceinline__ void mbar_arrive_tx(void* bar, unsigned int bytes) {
    asm volatile(\"mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\" :: \"r\"(smem_addr(bar)), \"r\"(bytes) : \"memory\");
}
__device__ __forceinline__ void mbar_wait(const void* bar, unsigned int parity) {
    const unsigned int a = smem_addr(bar);
    unsigned int done = 0;
    while (!done) {
        asm volatile(\"{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\"
                     : \"=r\"(done) : \"r\"(a), \"r\"(parity) : \"memory\");
    }
}
"
            }
            Helper::CpAsyncBulk => {
                "__device__ __forceinline__ void cp_async_bulk(void* dst, const void* src, unsigned int bytes, void* bar) {
    asm volatile(\"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\"
                 :: \"r\"(smem_addr(dst)), \"l\"(src), \"r\"(bytes), \"r\"(smem_addr(bar)) : \"memory\");
}
"
            }
            Helper::GridDependency => {
                "// Programmatic dependent launch (sm_90+; no-ops for a launch without it).
__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(\"griddepcontrol.launch_dependents;\" ::: \"memory\");
#endif
}
"
            }
        }
    }
}

/// Which part of the `wgmma` helpers [`wgmma_source`] renders.
#[derive(Clone, Copy)]
enum WgmmaShape {
    /// Fences, groups and the descriptor.
    Base,
    /// `wgmma_bf16_ss` at N 16, 32, 64.
    Ss,
    /// `wgmma_bf16_rs` at N 8 to 256.
    Rs,
    /// `wgmma_bf16_rs_mn` (N 64).
    RsMn,
}

/// The `wgmma` helpers: fences and the shared-memory descriptor, or one overload per shape of
/// one instruction form.
fn wgmma_source(part: WgmmaShape) -> &'static str {
    static SRC: std::sync::OnceLock<[String; 4]> = std::sync::OnceLock::new();
    let all = SRC.get_or_init(|| {
        let base = String::from(
            "__device__ __forceinline__ void wgmma_fence() { asm volatile(\"wgmma.fence.sync.aligned;\" ::: \"memory\"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile(\"wgmma.commit_group.sync.aligned;\" ::: \"memory\"); }
template <int N> __device__ __forceinline__ void wgmma_wait() { asm volatile(\"wgmma.wait_group.sync.aligned %0;\" :: \"n\"(N) : \"memory\"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\"); }
// The low word of a 128-byte-swizzled operand's descriptor: address / 16, 8-row groups 1024
// bytes apart; the high word (the same stride, swizzle mode 128 B) is WGMMA_DESC_HI.
__device__ __forceinline__ unsigned int wgmma_desc(const void* p) { return (smem_addr(p) >> 4) | (64u << 16); }
#define WGMMA_DESC_HI (((1ull << 30) | 64ull) << 32)
",
        );
        let regs = |n: usize, from: usize| (from..from + n).map(|i| format!("%{i}")).collect::<Vec<_>>().join(", ");
        let outs = |n: usize| (0..n).map(|i| format!("\"+f\"(d[{i}])")).collect::<Vec<_>>().join(", ");
        let mut ss = String::new();
        for n in [16usize, 32, 64] {
            let m = n / 2;
            ss.push_str(&format!(
                "__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[{m}], unsigned int a, unsigned int b) {{
    asm volatile(\"{{ .reg .pred p; setp.ne.b32 p, %{p}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, %{da}, %{db}, p, 1, 1, 0, 0; }}\"
                 : {outs}
                 : \"l\"(WGMMA_DESC_HI | a), \"l\"(WGMMA_DESC_HI | b), \"r\"(1));
}}
",
                d = regs(m, 0),
                da = m,
                db = m + 1,
                p = m + 2,
                outs = outs(m),
            ));
        }
        let mut rs = String::new();
        for n in [8usize, 16, 32, 64, 128, 256] {
            let m = n / 2;
            rs.push_str(&format!(
                "__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[{m}], const unsigned int* a, unsigned int b, bool accumulate) {{
    asm volatile(\"{{ .reg .pred p; setp.ne.b32 p, %{p}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {{%{a0}, %{a1}, %{a2}, %{a3}}}, %{db}, p, 1, 1, 0; }}\"
                 : {outs}
                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(WGMMA_DESC_HI | b), \"r\"((unsigned int)accumulate));
}}
",
                d = regs(m, 0),
                a0 = m,
                a1 = m + 1,
                a2 = m + 2,
                a3 = m + 3,
                db = m + 4,
                p = m + 5,
                outs = outs(m),
            ));
        }
        let rs_mn = format!(
            "__device__ __forceinline__ void wgmma_bf16_rs_mn(float (&d)[32], const unsigned int* a, unsigned int b) {{
    asm volatile(\"{{ .reg .pred p; setp.ne.b32 p, %37, 0; wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{d}}}, {{%32, %33, %34, %35}}, %36, p, 1, 1, 1; }}\"
                 : {outs}
                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(WGMMA_DESC_HI | b), \"r\"(1));
}}
",
            d = regs(32, 0),
            outs = outs(32),
        );
        [base, ss, rs, rs_mn]
    });
    &all[part as usize]
}
