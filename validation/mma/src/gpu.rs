//! The GPU side: the kernels of kernels/mma.cu compiled by NVRTC with the product's options, a
//! context, and the two experiments' launches. Every failure is an [`Env`] error (exit 3).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

/// The kernel source.
pub const SOURCE: &str = include_str!("../kernels/mma.cu");
/// Its entry points.
pub const ENTRIES: &[&str] = &["mma_verify", "split3", "gemm_v2"];

/// An environment or runtime failure (no GPU, no NVRTC, a driver error).
#[derive(Debug)]
pub struct Env(pub String);

impl std::fmt::Display for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Env {}

fn env<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> Env + '_ {
    move |e| Env(format!("{what}: {e:?}"))
}

/// The product's NVRTC options (tarfa-cuda/src/compile.rs): no fma contraction, subnormals
/// kept, correctly rounded division and square root.
pub fn options(arch: &'static str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        use_fast_math: None,
        maxrregcount: None,
        include_paths: Vec::new(),
        arch: Some(arch),
        name: Some("mma.cu".into()),
        options: vec!["--std=c++17".into()],
    }
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// PTX of kernels/mma.cu for `arch`.
pub fn compile(arch: &'static str) -> Result<String, Env> {
    if !nvrtc_present() {
        return Err(Env(
            "libnvrtc cannot be loaded (set LD_LIBRARY_PATH to CUDA 13's lib64)".into(),
        ));
    }
    let ptx = compile_ptx_with_opts(SOURCE, options(arch)).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            Env(format!("NVRTC failed: {}", log.to_string_lossy()))
        }
        other => Env(format!("NVRTC failed: {other:?}")),
    })?;
    Ok(ptx.to_src())
}

/// An open device with the kernels loaded.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    pub verify: CudaFunction,
    pub split3: CudaFunction,
    pub gemm: CudaFunction,
    pub name: String,
    pub cc: (i32, i32),
}

impl Gpu {
    pub fn open() -> Result<Gpu, Env> {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Env("libcuda cannot be loaded: no NVIDIA driver here".into()));
        }
        let ctx = CudaContext::new(0).map_err(env("open GPU 0"))?;
        let cc = ctx
            .compute_capability()
            .map_err(env("compute capability"))?;
        let name = ctx.name().map_err(env("device name"))?;
        if cc != (9, 0) {
            eprintln!(
                "warning: device {name} is sm_{}{}, the model is Hopper's (sm_90)",
                cc.0, cc.1
            );
        }
        let arch: &'static str = Box::leak(format!("compute_{}{}", cc.0, cc.1).into_boxed_str());
        let ptx = compile(arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(env("load the module"))?;
        let f = |n: &str| module.load_function(n).map_err(env("find a kernel"));
        Ok(Gpu {
            verify: f("mma_verify")?,
            split3: f("split3")?,
            gemm: f("gemm_v2")?,
            stream: ctx.default_stream(),
            _module: module,
            ctx,
            name,
            cc,
        })
    }

    /// D bits of `tiles` MMAs: a (256 per tile), b (128), c (128).
    pub fn run_mma(&self, a: &[u16], b: &[u16], c: &[u32]) -> Result<Vec<u32>, Env> {
        let tiles = (a.len() / 256) as u64;
        let s = &self.stream;
        let da = s.clone_htod(a).map_err(env("copy A"))?;
        let db = s.clone_htod(b).map_err(env("copy B"))?;
        let dc = s.clone_htod(c).map_err(env("copy C"))?;
        let mut dd = s.alloc_zeros::<u32>(c.len()).map_err(env("alloc D"))?;
        let threads = 256u32;
        let blocks = (tiles * 32).div_ceil(threads as u64) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = s.launch_builder(&self.verify);
        l.arg(&da).arg(&db).arg(&dc).arg(&mut dd).arg(&tiles);
        // SAFETY: the buffers hold `tiles` tiles each, as the kernel reads and writes.
        unsafe { l.launch(cfg) }.map_err(env("launch mma_verify"))?;
        s.clone_dtoh(&dd).map_err(env("copy D back"))
    }
}

/// The prototype GEMM on the device: buffers and a launcher for one shape.
pub struct Gemm<'g> {
    gpu: &'g Gpu,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    w: cudarc::driver::CudaSlice<u16>,
    x: cudarc::driver::CudaSlice<f32>,
    xs: cudarc::driver::CudaSlice<u16>,
    out: cudarc::driver::CudaSlice<f32>,
}

impl<'g> Gemm<'g> {
    pub fn new(
        gpu: &'g Gpu,
        w: &[u16],
        x: &[f32],
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<Gemm<'g>, Env> {
        if !m.is_multiple_of(64) || !n.is_multiple_of(64) || !k.is_multiple_of(64) {
            return Err(Env(format!(
                "gemm {m}x{n}x{k}: M, N, K must be multiples of 64"
            )));
        }
        let s = &gpu.stream;
        Ok(Gemm {
            gpu,
            m,
            n,
            k,
            w: s.clone_htod(w).map_err(env("copy W"))?,
            x: s.clone_htod(x).map_err(env("copy X"))?,
            xs: s
                .alloc_zeros::<u16>(3 * n * k)
                .map_err(env("alloc the split"))?,
            out: s
                .alloc_zeros::<f32>(m * n)
                .map_err(env("alloc the output"))?,
        })
    }

    /// Split, then the GEMM (both timed together by the caller).
    pub fn launch(&mut self) -> Result<(), Env> {
        let s = &self.gpu.stream;
        let nk = (self.n * self.k) as u64;
        let (x1, mut rest) = self.xs.split_at_mut(self.n * self.k);
        let (mut x2, mut x3) = rest.split_at_mut(self.n * self.k);
        let mut x1 = x1;
        let mut l = s.launch_builder(&self.gpu.split3);
        l.arg(&self.x)
            .arg(&mut x1)
            .arg(&mut x2)
            .arg(&mut x3)
            .arg(&nk);
        let cfg = LaunchConfig {
            grid_dim: (nk.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x has n*k values, each plane n*k.
        unsafe { l.launch(cfg) }.map_err(env("launch split3"))?;
        let (m, n, k) = (self.m as i32, self.n as i32, self.k as i32);
        let mut l = s.launch_builder(&self.gpu.gemm);
        l.arg(&self.w)
            .arg(&self.xs)
            .arg(&mut self.out)
            .arg(&m)
            .arg(&n)
            .arg(&k);
        let cfg = LaunchConfig {
            grid_dim: ((self.m / 64) as u32, (self.n / 64) as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: shapes checked in new; w m*k, xs 3*n*k, out m*n.
        unsafe { l.launch(cfg) }.map_err(env("launch gemm_v2"))?;
        Ok(())
    }

    /// Milliseconds of `reps` launches (events), after one warm-up.
    pub fn time(&mut self, reps: usize) -> Result<f64, Env> {
        self.launch()?;
        self.gpu.stream.synchronize().map_err(env("sync"))?;
        let a = self
            .gpu
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(env("event"))?;
        let b = self
            .gpu
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(env("event"))?;
        a.record(&self.gpu.stream).map_err(env("record"))?;
        for _ in 0..reps {
            self.launch()?;
        }
        b.record(&self.gpu.stream).map_err(env("record"))?;
        self.gpu.stream.synchronize().map_err(env("sync"))?;
        Ok(a.elapsed_ms(&b).map_err(env("elapsed"))? as f64 / reps as f64)
    }

    /// The output, `out[n * m + r]`.
    pub fn output(&self) -> Result<Vec<f32>, Env> {
        self.gpu
            .stream
            .clone_dtoh(&self.out)
            .map_err(env("copy the output back"))
    }
}
