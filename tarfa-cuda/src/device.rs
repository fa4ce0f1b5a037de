//! The device: context, stream, compiled kernels, plain device allocations, copies and launches,
//! each failure turned into a [`CudaError`] that names what failed.
//!
//! Memory is taken with `cuMemAlloc` only (never managed memory, never a stream-ordered pool),
//! freed when its [`DevBuf`] drops. All work goes to one stream in order; nothing is read back
//! except where the caller asks (a step's logits and router records).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaFunction, CudaGraph, CudaStream, DriverError};

use super::compile::{arch_for, compile_all};
use super::{CudaError, CudaOptions, DeviceInfo};

/// Whether the driver library can be loaded (cudarc panics on first use when it cannot).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// Maps a driver error to the error the CLI reports, naming `what` failed.
pub(crate) fn driver_err(e: DriverError, what: impl Into<String>) -> CudaError {
    let what = what.into();
    let detail = describe(e);
    use CUresult::*;
    match e.0 {
        CUDA_ERROR_OUT_OF_MEMORY => CudaError::OutOfMemory { what, detail },
        CUDA_ERROR_ILLEGAL_ADDRESS
        | CUDA_ERROR_LAUNCH_FAILED
        | CUDA_ERROR_MISALIGNED_ADDRESS
        | CUDA_ERROR_ILLEGAL_INSTRUCTION
        | CUDA_ERROR_INVALID_ADDRESS_SPACE
        | CUDA_ERROR_INVALID_PC
        | CUDA_ERROR_HARDWARE_STACK_ERROR
        | CUDA_ERROR_ASSERT
        | CUDA_ERROR_LAUNCH_TIMEOUT
        | CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES => CudaError::KernelFailed { what, detail },
        CUDA_ERROR_ECC_UNCORRECTABLE
        | CUDA_ERROR_NVLINK_UNCORRECTABLE
        | CUDA_ERROR_DEVICE_UNAVAILABLE
        | CUDA_ERROR_NO_DEVICE
        | CUDA_ERROR_CONTEXT_IS_DESTROYED
        | CUDA_ERROR_DEINITIALIZED
        | CUDA_ERROR_SYSTEM_NOT_READY
        | CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUDA_ERROR_UNKNOWN => CudaError::DeviceLost { what, detail },
        _ => CudaError::Driver { what, detail },
    }
}

fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if text.is_empty() {
        name
    } else {
        format!("{name}: {text}")
    }
}

/// A plain device allocation.
pub(crate) struct DevBuf {
    ptr: u64,
    bytes: usize,
    owner: Owner,
}

/// Who frees a [`DevBuf`].
enum Owner {
    Cuda(Arc<CudaContext>),
    #[cfg(any(test, feature = "mock-device"))]
    Mock(Arc<Mutex<super::mock::Memory>>),
}

impl DevBuf {
    /// The device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Cuda(ctx) => {
                if self.ptr != 0 && ctx.bind_to_thread().is_ok() {
                    // SAFETY: allocated by cuMemAlloc in this context and freed once; the
                    // stream's work that used it was synchronised before any buffer is dropped
                    // (buffers are only replaced between synchronised steps).
                    let _ = unsafe { cu::free_sync(self.ptr) };
                }
            }
            #[cfg(any(test, feature = "mock-device"))]
            Owner::Mock(m) => m.lock().unwrap_or_else(|p| p.into_inner()).free(self.ptr),
        }
    }
}

// SAFETY: a device address and a context handle; cudarc's context is Send + Sync.
unsafe impl Send for DevBuf {}
unsafe impl Sync for DevBuf {}

/// A kernel argument: device pointers, integers and floats, passed by value.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device address (a `T*` parameter); 0 is `nullptr`.
    Ptr(u64),
    /// An `int` parameter.
    I32(i32),
    /// A `long` parameter.
    I64(i64),
    /// A `float` parameter.
    F32(f32),
}

/// The context, the stream and the loaded kernels of one device.
pub(crate) struct Gpu {
    inner: Inner,
    pub(crate) info: DeviceInfo,
    sync_each: bool,
    last_kernel: Mutex<&'static str>,
    /// `ManyKernels::code` of the kernels a step of many tokens takes (changes speed only).
    many: std::sync::atomic::AtomicU8,
}

enum Inner {
    Cuda {
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        funcs: HashMap<&'static str, CudaFunction>,
    },
    /// Host memory and Rust reference kernels: tests the orchestration without a GPU.
    #[cfg(any(test, feature = "mock-device"))]
    Mock(Arc<Mutex<super::mock::Memory>>),
}

/// Opens device `ordinal` after checking that the driver and NVRTC libraries load.
pub(crate) fn open_context(ordinal: usize) -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    if !super::compile::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let count = {
        cu::init().map_err(|e| match e.0 {
            CUresult::CUDA_ERROR_NO_DEVICE => CudaError::NoDevice,
            _ => driver_err(e, "initialise the CUDA driver"),
        })?;
        cu::device::get_count().map_err(|e| driver_err(e, "count the CUDA devices"))?
    };
    if count <= 0 {
        return Err(CudaError::NoDevice);
    }
    if ordinal >= count as usize {
        return Err(CudaError::NoSuchDevice {
            ordinal,
            count: count as usize,
        });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_err(e, "create the CUDA context"))?;
    let name = ctx
        .name()
        .map_err(|e| driver_err(e, "read the device name"))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| driver_err(e, "read the compute capability"))?;
    let (free, total) = ctx
        .mem_get_info()
        .map_err(|e| driver_err(e, "read the device memory"))?;
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| driver_err(e, "read the multiprocessor count"))?;
    let mut driver_version = 0i32;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(|e| driver_err(e, "read the driver version"))?;
    Ok((
        ctx,
        DeviceInfo {
            ordinal,
            name,
            compute_capability: (major, minor),
            total_memory: total,
            free_memory: free,
            multiprocessors: sms.max(0) as u32,
            driver_version,
            arch: arch_for(major, minor),
        },
    ))
}

impl Gpu {
    /// Opens the device, compiles every kernel for its architecture (once per process) and
    /// loads them.
    pub(crate) fn open(opts: &CudaOptions) -> Result<Gpu, CudaError> {
        let (ctx, info) = open_context(opts.device)?;
        // One stream, in order: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any buffer or stream exists.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_err(e, "create the CUDA stream"))?;
        let mut funcs = HashMap::new();
        for (file, ptx) in compile_all(info.arch)? {
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(|e| driver_err(e, format!("load the module of kernels/{}", file.name)))?;
            for &entry in file.entries {
                let f = module.load_function(entry).map_err(|e| {
                    driver_err(e, format!("find kernel {entry} in kernels/{}", file.name))
                })?;
                funcs.insert(entry, f);
            }
        }
        let sync_each = opts.tuning.sync_each_kernel;
        let gpu = Gpu {
            inner: Inner::Cuda { ctx, stream, funcs },
            info,
            sync_each,
            last_kernel: Mutex::new("(none)"),
            many: std::sync::atomic::AtomicU8::new(opts.tuning.many.code()),
        };
        // the kernels whose dynamic shared memory passes 48 KiB: their largest, once
        for (name, bytes) in super::ops::big_shared_kernels() {
            gpu.allow_shared(name, bytes)?;
        }
        Ok(gpu)
    }

    /// A device made of host memory whose kernels are the Rust reference functions.
    #[cfg(any(test, feature = "mock-device"))]
    pub(crate) fn mock() -> Gpu {
        Gpu::mock_with_memory(1 << 36)
    }

    /// A mock device that reports `free` bytes of free memory.
    #[cfg(any(test, feature = "mock-device"))]
    pub(crate) fn mock_with_memory(free: usize) -> Gpu {
        Gpu {
            inner: Inner::Mock(Arc::new(Mutex::new(super::mock::Memory::default()))),
            info: DeviceInfo {
                ordinal: 0,
                name: "mock (host memory, reference kernels)".into(),
                compute_capability: (9, 0),
                total_memory: free,
                free_memory: free,
                multiprocessors: 1,
                driver_version: 13000,
                arch: "compute_90",
            },
            sync_each: false,
            last_kernel: Mutex::new("(none)"),
            many: std::sync::atomic::AtomicU8::new(crate::ManyKernels::default().code()),
        }
    }

    /// Which kernels a step of many tokens takes.
    pub(crate) fn many(&self) -> crate::ManyKernels {
        crate::ManyKernels::of_code(self.many.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Changes [`Gpu::many`] (between steps: a step reads it as it launches).
    pub(crate) fn set_many(&self, m: crate::ManyKernels) {
        self.many
            .store(m.code(), std::sync::atomic::Ordering::Relaxed);
    }

    fn cuda(&self) -> Option<(&Arc<CudaContext>, &Arc<CudaStream>)> {
        match &self.inner {
            Inner::Cuda { ctx, stream, .. } => Some((ctx, stream)),
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => None,
        }
    }

    /// How many times the mock device launched each kernel (tests).
    #[cfg(test)]
    pub(crate) fn mock_launches(&self) -> std::collections::BTreeMap<&'static str, usize> {
        self.mock_mem().launched.clone()
    }

    /// How many synchronous host-to-device copies the mock device made, per what they copied
    /// (tests).
    #[cfg(test)]
    pub(crate) fn mock_writes(&self) -> std::collections::BTreeMap<String, usize> {
        self.mock_mem().wrote.clone()
    }

    #[cfg(any(test, feature = "mock-device"))]
    fn mock_mem(&self) -> std::sync::MutexGuard<'_, super::mock::Memory> {
        match &self.inner {
            Inner::Mock(m) => m.lock().unwrap_or_else(|p| p.into_inner()),
            Inner::Cuda { .. } => unreachable!("not a mock device"),
        }
    }

    fn bind(&self) -> Result<(), CudaError> {
        match self.cuda() {
            Some((ctx, _)) => ctx
                .bind_to_thread()
                .map_err(|e| driver_err(e, "bind the CUDA context to this thread")),
            None => Ok(()),
        }
    }

    /// Whether every kernel is waited for (`CudaTuning::sync_each_kernel`): no graphs then.
    pub(crate) fn sync_each_kernel(&self) -> bool {
        self.sync_each
    }

    /// Free and total device memory now.
    pub(crate) fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        match self.cuda() {
            Some((ctx, _)) => ctx
                .mem_get_info()
                .map_err(|e| driver_err(e, "read the device memory")),
            None => Ok((self.info.free_memory, self.info.total_memory)),
        }
    }

    /// `bytes` of device memory, zero-filled. `what` names the allocation in errors.
    pub(crate) fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf, CudaError> {
        let n = bytes.max(16);
        let Some((ctx, stream)) = self.cuda() else {
            #[cfg(any(test, feature = "mock-device"))]
            {
                let m = match &self.inner {
                    Inner::Mock(m) => m.clone(),
                    Inner::Cuda { .. } => unreachable!(),
                };
                let ptr = self.mock_mem().alloc(n);
                return Ok(DevBuf {
                    ptr,
                    bytes: n,
                    owner: Owner::Mock(m),
                });
            }
            #[cfg(not(any(test, feature = "mock-device")))]
            unreachable!()
        };
        self.bind()?;
        // SAFETY: a plain allocation of n bytes in the bound context.
        let ptr = match unsafe { cu::malloc_sync(n) } {
            Ok(p) => p,
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = self.mem_info().unwrap_or((0, 0));
                return Err(CudaError::oom(what, n, free, total));
            }
            Err(e) => return Err(driver_err(e, format!("allocate {n} bytes for {what}"))),
        };
        let buf = DevBuf {
            ptr,
            bytes: n,
            owner: Owner::Cuda(ctx.clone()),
        };
        // SAFETY: the range was just allocated.
        unsafe { cu::memset_d8_async(ptr, 0, n, stream.cu_stream()) }
            .map_err(|e| driver_err(e, format!("zero {what}")))?;
        Ok(buf)
    }

    /// Copies `src` to device address `dst` (which must have room) and waits for the copy.
    pub(crate) fn write<T: Copy>(&self, dst: u64, src: &[T], what: &str) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        let Some((_, stream)) = self.cuda() else {
            #[cfg(any(test, feature = "mock-device"))]
            {
                // SAFETY: plain-data values viewed as bytes
                let bytes = unsafe {
                    std::slice::from_raw_parts(
                        src.as_ptr() as *const u8,
                        std::mem::size_of_val(src),
                    )
                };
                let mut mem = self.mock_mem();
                mem.write(dst, bytes);
                *mem.wrote.entry(what.to_string()).or_default() += 1;
                return Ok(());
            }
            #[cfg(not(any(test, feature = "mock-device")))]
            unreachable!()
        };
        self.bind()?;
        // SAFETY: the caller sized dst; the stream is synchronised before src can go away.
        unsafe { cu::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| driver_err(e, format!("copy {what} to the device")))?;
        self.sync(what)
    }

    /// A new buffer holding `src`.
    pub(crate) fn upload<T: Copy>(&self, src: &[T], what: &str) -> Result<DevBuf, CudaError> {
        let buf = self.alloc(std::mem::size_of_val(src), what)?;
        self.write(buf.ptr(), src, what)?;
        Ok(buf)
    }

    /// Copies `n` values from device address `src` to the host, after all queued work.
    pub(crate) fn read<T: Copy + Default>(
        &self,
        src: u64,
        n: usize,
        what: &str,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); n];
        if n == 0 {
            return Ok(out);
        }
        let Some((_, stream)) = self.cuda() else {
            #[cfg(any(test, feature = "mock-device"))]
            {
                // SAFETY: plain-data values viewed as bytes
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(
                        out.as_mut_ptr() as *mut u8,
                        n * std::mem::size_of::<T>(),
                    )
                };
                self.mock_mem().read(src, bytes);
                return Ok(out);
            }
            #[cfg(not(any(test, feature = "mock-device")))]
            unreachable!()
        };
        self.bind()?;
        // SAFETY: out has room for n values; synchronised before out is used.
        unsafe { cu::memcpy_dtoh_async(&mut out[..], src, stream.cu_stream()) }
            .map_err(|e| self.async_err(e, &format!("copy {what} from the device")))?;
        self.sync(what)?;
        Ok(out)
    }

    /// `rows` consecutive rows of `width` values from `src`, each into its own vector, with one
    /// synchronisation: a step's logits go straight into the rows it returns, with no flat copy
    /// to split on the host (at 128 sequences that copy was 78 MB a step).
    pub(crate) fn read_rows<T: Copy + Default>(
        &self,
        src: u64,
        rows: usize,
        width: usize,
        what: &str,
    ) -> Result<Vec<Vec<T>>, CudaError> {
        let size = std::mem::size_of::<T>();
        let mut out: Vec<Vec<T>> = (0..rows).map(|_| vec![T::default(); width]).collect();
        if rows == 0 || width == 0 {
            return Ok(out);
        }
        let Some((_, stream)) = self.cuda() else {
            #[cfg(any(test, feature = "mock-device"))]
            {
                let mut mem = self.mock_mem();
                for (r, row) in out.iter_mut().enumerate() {
                    // SAFETY: plain-data values viewed as bytes
                    let bytes = unsafe {
                        std::slice::from_raw_parts_mut(row.as_mut_ptr() as *mut u8, width * size)
                    };
                    mem.read(src + (r * width * size) as u64, bytes);
                }
                return Ok(out);
            }
            #[cfg(not(any(test, feature = "mock-device")))]
            unreachable!()
        };
        self.bind()?;
        for (r, row) in out.iter_mut().enumerate() {
            // SAFETY: row has room for width values; synchronised before any row is used.
            unsafe {
                cu::memcpy_dtoh_async(
                    &mut row[..],
                    src + (r * width * size) as u64,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| self.async_err(e, &format!("copy {what} from the device")))?;
        }
        self.sync(what)?;
        Ok(out)
    }

    /// Device-to-device copy of `bytes`, queued.
    pub(crate) fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        what: &str,
    ) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        let Some((_, stream)) = self.cuda() else {
            #[cfg(any(test, feature = "mock-device"))]
            {
                let mut m = self.mock_mem();
                let mut tmp = vec![0u8; bytes];
                m.read(src, &mut tmp);
                m.write(dst, &tmp);
                return Ok(());
            }
            #[cfg(not(any(test, feature = "mock-device")))]
            unreachable!()
        };
        self.bind()?;
        // SAFETY: both ranges are live allocations of at least `bytes` (the caller's sizes).
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
            .map_err(|e| driver_err(e, format!("copy {what} on the device")))
    }

    /// Waits for the stream; an error here is a kernel's (or copy's) asynchronous failure.
    pub(crate) fn sync(&self, what: &str) -> Result<(), CudaError> {
        let Some((_, stream)) = self.cuda() else {
            return Ok(());
        };
        stream
            .synchronize()
            .map_err(|e| self.async_err(e, &format!("wait for {what}")))
    }

    /// An asynchronous failure: name the last kernel launched as well.
    fn async_err(&self, e: DriverError, what: &str) -> CudaError {
        let last = *self.last_kernel.lock().unwrap_or_else(|p| p.into_inner());
        driver_err(
            e,
            format!("{what} (last kernel launched: {last}; --cuda-sync checks after every kernel)"),
        )
    }

    /// Launches kernel `name`. With [`CudaTuning::sync_each_kernel`](crate::CudaTuning)
    /// waits for it, so that a failure names this kernel.
    pub(crate) fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &[Arg],
    ) -> Result<(), CudaError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let (stream, funcs) = match &self.inner {
            Inner::Cuda { stream, funcs, .. } => (stream, funcs),
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => {
                *self.last_kernel.lock().unwrap_or_else(|p| p.into_inner()) = name;
                return super::mock::launch(
                    &mut self.mock_mem(),
                    name,
                    grid,
                    block,
                    shared_bytes,
                    args,
                );
            }
        };
        let f = funcs
            .get(name)
            .ok_or_else(|| CudaError::Internal(format!("kernel {name} is not loaded")))?;
        if grid.1 > 65535 || grid.2 > 65535 {
            return Err(CudaError::Internal(format!(
                "kernel {name}: grid {grid:?} exceeds the device's limits"
            )));
        }
        // Each parameter's bytes in the low bytes of one u64 (little-endian): the driver reads
        // as many bytes as the kernel's parameter has.
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        *self.last_kernel.lock().unwrap_or_else(|p| p.into_inner()) = name;
        self.bind()?;
        // SAFETY: `params` matches the kernel's signature (each call site mirrors the .cu
        // declaration) and every pointer argument is a live allocation sized for the launch.
        unsafe {
            cu::launch_kernel(
                cuda_function(f),
                grid,
                block,
                shared_bytes,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| driver_err(e, format!("launch kernel {name}")))?;
        if self.sync_each {
            stream
                .synchronize()
                .map_err(|e| driver_err(e, format!("kernel {name}")))?;
        }
        Ok(())
    }
}

/// One kernel launch, recorded so that it can be replayed, captured into a graph or timed.
#[derive(Clone, Debug)]
pub(crate) struct Launch {
    pub(crate) name: &'static str,
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: (u32, u32, u32),
    pub(crate) shared: u32,
    pub(crate) args: Vec<Arg>,
    /// The kernel calls grid_dep_wait before it reads anything an earlier kernel wrote, so it
    /// may be launched with programmatic stream serialisation (kernels/common.cuh).
    pub(crate) pdl: bool,
    /// What it computes, for the per-kernel profile.
    pub(crate) label: &'static str,
    /// Bytes of weights it reads (for the profile's bandwidth).
    pub(crate) bytes: u64,
}

/// A captured, instantiated CUDA graph (the mock device has none: it replays the launches).
pub(crate) enum GpuGraph {
    Cuda(CudaGraph),
    #[cfg(any(test, feature = "mock-device"))]
    Mock(Vec<Launch>),
}

impl Gpu {
    /// Launches `l`, with programmatic dependent launch when `pdl` and the kernel allows it.
    pub(crate) fn launch_rec(&self, l: &Launch, pdl: bool) -> Result<(), CudaError> {
        if !(pdl && l.pdl) {
            return self.launch(l.name, l.grid, l.block, l.shared, &l.args);
        }
        let (stream, funcs) = match &self.inner {
            Inner::Cuda { stream, funcs, .. } => (stream, funcs),
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => return self.launch(l.name, l.grid, l.block, l.shared, &l.args),
        };
        let f = funcs
            .get(l.name)
            .ok_or_else(|| CudaError::Internal(format!("kernel {} is not loaded", l.name)))?;
        let mut vals: Vec<u64> = l
            .args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        *self.last_kernel.lock().unwrap_or_else(|p| p.into_inner()) = l.name;
        self.bind()?;
        // SAFETY: zero-initialised plain-data attribute; only the id and one union field are set.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: l.grid.0,
            gridDimY: l.grid.1,
            gridDimZ: l.grid.2,
            blockDimX: l.block.0,
            blockDimY: l.block.1,
            blockDimZ: l.block.2,
            sharedMemBytes: l.shared,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as in `launch`: the parameters mirror the kernel's declaration and every
        // pointer is a live allocation sized for the launch.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                cuda_function(f),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| driver_err(e, format!("launch kernel {} (programmatic)", l.name)))?;
        if self.sync_each {
            stream
                .synchronize()
                .map_err(|e| driver_err(e, format!("kernel {}", l.name)))?;
        }
        Ok(())
    }

    /// Captures `launches` into a graph (programmatic edges where `pdl` and a kernel allows)
    /// and instantiates it. On failure the stream leaves capture mode and nothing is kept.
    pub(crate) fn capture(&self, launches: &[Launch], pdl: bool) -> Result<GpuGraph, CudaError> {
        let stream = match &self.inner {
            Inner::Cuda { stream, .. } => stream,
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => return Ok(GpuGraph::Mock(launches.to_vec())),
        };
        self.bind()?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_err(e, "begin a graph capture"))?;
        let mut failed = None;
        for l in launches {
            if let Err(e) = self.launch_rec(l, pdl) {
                failed = Some(e);
                break;
            }
        }
        let end = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        if let Some(e) = failed {
            return Err(e);
        }
        match end {
            Ok(Some(g)) => Ok(GpuGraph::Cuda(g)),
            Ok(None) => Err(CudaError::Internal("the graph capture was empty".into())),
            Err(e) => Err(driver_err(e, "end the graph capture and instantiate it")),
        }
    }

    /// Launches a captured graph on the stream.
    pub(crate) fn launch_graph(&self, g: &GpuGraph) -> Result<(), CudaError> {
        match g {
            GpuGraph::Cuda(g) => {
                *self.last_kernel.lock().unwrap_or_else(|p| p.into_inner()) = "(a decode graph)";
                g.launch()
                    .map_err(|e| driver_err(e, "launch the decode graph"))?;
                if self.sync_each {
                    self.sync("the decode graph")?;
                }
                Ok(())
            }
            #[cfg(any(test, feature = "mock-device"))]
            GpuGraph::Mock(v) => {
                for l in v {
                    self.launch(l.name, l.grid, l.block, l.shared, &l.args)?;
                }
                Ok(())
            }
        }
    }

    /// Resident blocks of `name` per multiprocessor with `block` threads and `shared` bytes of
    /// dynamic shared memory (at least 1). The mock device says 2.
    pub(crate) fn occupancy(&self, name: &'static str, block: u32, shared: u32) -> u32 {
        let funcs = match &self.inner {
            Inner::Cuda { funcs, .. } => funcs,
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => return 2,
        };
        let Some(f) = funcs.get(name) else {
            return 1;
        };
        let mut n = 0i32;
        // SAFETY: writes one int.
        let r = unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                cuda_function(f),
                block as i32,
                shared as usize,
            )
        };
        if r == CUresult::CUDA_SUCCESS {
            n.max(1) as u32
        } else {
            1
        }
    }

    /// Registers per thread of a kernel as the driver compiled it (0 on the mock device).
    pub(crate) fn registers(&self, name: &'static str) -> i32 {
        let funcs = match &self.inner {
            Inner::Cuda { funcs, .. } => funcs,
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => return 0,
        };
        let Some(f) = funcs.get(name) else {
            return 0;
        };
        let mut n = 0i32;
        // SAFETY: writes one int.
        let _ = unsafe {
            sys::cuFuncGetAttribute(
                &mut n,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
                cuda_function(f),
            )
        };
        n
    }

    /// Lets kernel `name` take `bytes` of dynamic shared memory (the function's limit: a later
    /// call with fewer bytes lowers it, so callers set each kernel's largest). Needed whenever
    /// the dynamic part plus the kernel's static shared memory exceed 48 KiB; set from 16 KiB up.
    pub(crate) fn allow_shared(&self, name: &'static str, bytes: u32) -> Result<(), CudaError> {
        let funcs = match &self.inner {
            Inner::Cuda { funcs, .. } => funcs,
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => return Ok(()),
        };
        if bytes <= 16 * 1024 {
            return Ok(());
        }
        let f = funcs
            .get(name)
            .ok_or_else(|| CudaError::Internal(format!("kernel {name} is not loaded")))?;
        self.bind()?;
        // SAFETY: sets one attribute of a loaded function.
        unsafe {
            sys::cuFuncSetAttribute(
                cuda_function(f),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .result()
        .map_err(|e| {
            driver_err(
                e,
                format!("allow {bytes} bytes of shared memory for {name}"),
            )
        })
    }

    /// Milliseconds each launch of `launches` took, timed with events between consecutive
    /// launches (no programmatic launch: each kernel runs alone). The mock device gives zeros.
    pub(crate) fn time_launches(&self, launches: &[Launch]) -> Result<Vec<f64>, CudaError> {
        let (ctx, stream) = match &self.inner {
            Inner::Cuda { ctx, stream, .. } => (ctx, stream),
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => {
                for l in launches {
                    self.launch_rec(l, false)?;
                }
                return Ok(vec![0.0; launches.len()]);
            }
        };
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut ev = Vec::with_capacity(launches.len() + 1);
        for _ in 0..=launches.len() {
            ev.push(
                ctx.new_event(flags)
                    .map_err(|e| driver_err(e, "create an event"))?,
            );
        }
        for (i, l) in launches.iter().enumerate() {
            ev[i]
                .record(stream)
                .map_err(|e| driver_err(e, "record an event"))?;
            self.launch_rec(l, false)?;
        }
        ev[launches.len()]
            .record(stream)
            .map_err(|e| driver_err(e, "record an event"))?;
        self.sync("the timed launches")?;
        let mut out = Vec::with_capacity(launches.len());
        for i in 0..launches.len() {
            let ms = ev[i]
                .elapsed_ms(&ev[i + 1])
                .map_err(|e| driver_err(e, "read an event"))?;
            out.push(ms as f64);
        }
        Ok(out)
    }

    /// Milliseconds `f` takes on the stream, timed with events (wall time on the mock device).
    pub(crate) fn time<F: FnMut() -> Result<(), CudaError>>(
        &self,
        mut f: F,
    ) -> Result<f64, CudaError> {
        let (ctx, stream) = match &self.inner {
            Inner::Cuda { ctx, stream, .. } => (ctx, stream),
            #[cfg(any(test, feature = "mock-device"))]
            Inner::Mock(_) => {
                let t = std::time::Instant::now();
                f()?;
                return Ok(t.elapsed().as_secs_f64() * 1e3);
            }
        };
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let a = ctx
            .new_event(flags)
            .map_err(|e| driver_err(e, "create an event"))?;
        let b = ctx
            .new_event(flags)
            .map_err(|e| driver_err(e, "create an event"))?;
        a.record(stream)
            .map_err(|e| driver_err(e, "record an event"))?;
        f()?;
        b.record(stream)
            .map_err(|e| driver_err(e, "record an event"))?;
        self.sync("a timed region")?;
        Ok(a.elapsed_ms(&b)
            .map_err(|e| driver_err(e, "read an event"))? as f64)
    }

    /// Device-to-device copy rate of this GPU in GB/s, counting bytes read plus bytes written:
    /// the median of `reps` copies of `bytes` between two fresh buffers, timed with events.
    pub(crate) fn copy_rate(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        let a = self.alloc(bytes, "the copy-rate source")?;
        let b = self.alloc(bytes, "the copy-rate destination")?;
        self.copy(b.ptr(), a.ptr(), bytes, "the copy-rate buffers")?;
        let mut ms = Vec::new();
        for _ in 0..reps.max(1) {
            ms.push(self.time(|| self.copy(b.ptr(), a.ptr(), bytes, "the copy-rate buffers"))?);
        }
        ms.sort_by(f64::total_cmp);
        let med = ms[ms.len() / 2].max(1e-9);
        Ok(2.0 * bytes as f64 / (med * 1e-3) / 1e9)
    }

    /// Copies `src` to device address `dst` without waiting. A pageable source is staged by the
    /// driver before this returns and may be dropped right after; a page-locked one is read by
    /// the copy itself, in stream order, and must live until the stream has passed it.
    pub(crate) fn write_async<T: Copy>(
        &self,
        dst: u64,
        src: &[T],
        what: &str,
    ) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        let Some((_, stream)) = self.cuda() else {
            return self.write(dst, src, what);
        };
        self.bind()?;
        // SAFETY: dst is sized by the caller; pageable sources are staged before the call returns.
        unsafe { cu::memcpy_htod_async(dst, src, stream.cu_stream()) }
            .map_err(|e| driver_err(e, format!("copy {what} to the device")))
    }
}

/// Page-locks the warm tier's buffers in the device's context ([`tarfa_stream::HostPin`]):
/// `cuMemHostRegister` (portable), called from the store's reader threads.
struct CudaHostPin {
    ctx: Arc<CudaContext>,
}

impl tarfa_stream::HostPin for CudaHostPin {
    fn pin(&self, ptr: *mut u8, len: usize) -> bool {
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        // SAFETY: `ptr..ptr+len` is a live mapping owned by the caller, which unpins it before
        // unmapping it.
        unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        }
        .result()
        .is_ok()
    }

    fn unpin(&self, ptr: *mut u8) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `pin` and is still mapped.
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
        }
    }
}

/// Page-locked host memory (`cuMemAllocHost`): the source of asynchronous copies.
pub(crate) struct PinnedBuf {
    ptr: *mut u8,
    len: usize,
    /// The mock device's stand-in (plain memory), owned here while `ptr` points into it.
    #[cfg(any(test, feature = "mock-device"))]
    _plain: Option<Vec<u8>>,
    ctx: Option<Arc<CudaContext>>,
}

// SAFETY: plain owned host memory.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    /// The buffer as `n` values of `T` from byte offset `off` (bounds-checked).
    pub(crate) fn slice_mut<T: Copy>(&mut self, off: usize, n: usize) -> &mut [T] {
        let bytes = n * std::mem::size_of::<T>();
        assert!(
            off + bytes <= self.len && off.is_multiple_of(std::mem::align_of::<T>()),
            "pinned buffer overrun"
        );
        // SAFETY: in bounds and aligned (checked); the memory is owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off) as *mut T, n) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if let Some(ctx) = &self.ctx {
            if ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by cuMemAllocHost in `Gpu::alloc_pinned`, freed once.
                let _ = unsafe { cu::free_host(self.ptr as *mut c_void) };
            }
        }
    }
}

impl Gpu {
    /// A page-locker for the warm tier's buffers (`None` on the mock device).
    pub(crate) fn host_pin(&self) -> Option<Arc<dyn tarfa_stream::HostPin>> {
        self.cuda().map(|(ctx, _)| {
            Arc::new(CudaHostPin { ctx: ctx.clone() }) as Arc<dyn tarfa_stream::HostPin>
        })
    }

    /// `bytes` of page-locked host memory.
    pub(crate) fn alloc_pinned(&self, bytes: usize, what: &str) -> Result<PinnedBuf, CudaError> {
        let len = bytes.max(16);
        let Some((ctx, _)) = self.cuda() else {
            #[cfg(any(test, feature = "mock-device"))]
            {
                let mut plain = vec![0u8; len + 16];
                let ptr = plain.as_mut_ptr();
                let ptr = unsafe { ptr.add(ptr.align_offset(16)) };
                return Ok(PinnedBuf {
                    ptr,
                    len,
                    _plain: Some(plain),
                    ctx: None,
                });
            }
            #[cfg(not(any(test, feature = "mock-device")))]
            unreachable!()
        };
        self.bind()?;
        // SAFETY: a plain page-locked allocation in the bound context.
        let ptr = unsafe { cu::malloc_host(len, 0) }
            .map_err(|e| driver_err(e, format!("allocate {len} bytes of page-locked {what}")))?;
        Ok(PinnedBuf {
            ptr: ptr as *mut u8,
            len,
            #[cfg(any(test, feature = "mock-device"))]
            _plain: None,
            ctx: Some(ctx.clone()),
        })
    }
}

/// The raw handle of a loaded function.
fn cuda_function(f: &CudaFunction) -> sys::CUfunction {
    f.cu_function()
}
