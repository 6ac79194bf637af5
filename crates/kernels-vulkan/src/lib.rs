//! bonsai's Vulkan kernels: an ash context over `libvulkan.so.1` (loaded at run time, so nothing
//! Vulkan is needed to build), device buffers addressed by `bufferDeviceAddress`, and the compute
//! shaders of `shaders/` embedded as SPIR-V (see `build.rs`). Knows buffers and dimensions, never
//! the model: the engine's Vulkan backend composes these dispatches into the qwen35 forward.
//!
//! Every shader takes its buffers as device addresses in one push-constant block, so there are no
//! descriptor sets: a dispatch is bind pipeline, push constants, dispatch, barrier. Work is recorded
//! into one command buffer per [`Vulkan::run`] and waited for on a fence. The shaders are written for
//! correctness and batch invariance first: a row's result is computed by the same code in the same
//! order whatever the number of rows in the dispatch (see `shaders/common.glsl`).

mod spirv {
    include!(concat!(env!("OUT_DIR"), "/spirv.rs"));
}
pub mod retile;

use std::fmt;
use std::sync::{Arc, Mutex};

use ash::vk;

pub use spirv::{FROM_GLSLC, SOURCE_FNV64};

/// What went wrong, in words a user can act on.
#[derive(Debug, Clone)]
pub struct VkError(pub String);

impl fmt::Display for VkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VkError {}

pub type Result<T> = std::result::Result<T, VkError>;

fn vkerr(what: &str) -> impl Fn(vk::Result) -> VkError + '_ {
    move |e| VkError(format!("vulkan: {what}: {e}"))
}

/// Push constants of one dispatch, at most 128 bytes (the Vulkan minimum): device addresses first
/// (8 bytes each), then 32-bit scalars, in the order the shader's push-constant block declares them.
#[derive(Clone)]
pub struct Push {
    bytes: [u8; 128],
    len: usize,
    scalars: bool,
}

impl Default for Push {
    fn default() -> Self {
        Self::new()
    }
}

impl Push {
    pub fn new() -> Push {
        Push {
            bytes: [0; 128],
            len: 0,
            scalars: false,
        }
    }
    /// A buffer's device address (plus a byte offset into it).
    pub fn addr(mut self, b: &Buffer, byte_off: u64) -> Push {
        assert!(!self.scalars, "Push: addresses go before scalars");
        assert!(
            byte_off <= b.size && byte_off % 4 == 0,
            "Push: offset {byte_off} outside a {}-byte buffer",
            b.size
        );
        self.put(&(b.addr + byte_off).to_le_bytes());
        self
    }
    /// An unused address slot (a shader reads it only under a flag that is off).
    pub fn null(mut self) -> Push {
        assert!(!self.scalars, "Push: addresses go before scalars");
        self.put(&0u64.to_le_bytes());
        self
    }
    pub fn u32(mut self, v: u32) -> Push {
        self.scalars = true;
        self.put(&v.to_le_bytes());
        self
    }
    pub fn f32(mut self, v: f32) -> Push {
        self.scalars = true;
        self.put(&v.to_le_bytes());
        self
    }
    fn put(&mut self, b: &[u8]) {
        assert!(self.len + b.len() <= 128, "Push: over 128 bytes");
        self.bytes[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The compute shaders (one SPIR-V module each; `shaders/variants.txt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Rmsnorm,
    MvQ1,
    MvQ2,
    MvQ2g64,
    MvF32,
    Swiglu,
    GdnConv,
    GdnPrep,
    GdnStep,
    AttnPrep,
    Attn,
    /// Activation rows to int8 codes per 32 (`quant_q8.comp`).
    QuantQ8,
    /// The int8-activation mat-vecs (`mv_dot.comp`; need [`DeviceInfo::int_dot`]).
    MvDotQ1,
    MvDotQ2,
    MvDotQ2g64,
    /// `rmsnorm` with `quant_q8` of its output fused (`rmsnorm_q8.comp`).
    RmsnormQ8,
}

impl Kernel {
    const ALL: [Kernel; 16] = [
        Kernel::Rmsnorm,
        Kernel::MvQ1,
        Kernel::MvQ2,
        Kernel::MvQ2g64,
        Kernel::MvF32,
        Kernel::Swiglu,
        Kernel::GdnConv,
        Kernel::GdnPrep,
        Kernel::GdnStep,
        Kernel::AttnPrep,
        Kernel::Attn,
        Kernel::QuantQ8,
        Kernel::MvDotQ1,
        Kernel::MvDotQ2,
        Kernel::MvDotQ2g64,
        Kernel::RmsnormQ8,
    ];
    pub fn module(self) -> &'static str {
        match self {
            Kernel::Rmsnorm => "rmsnorm",
            Kernel::MvQ1 => "mv_q1",
            Kernel::MvQ2 => "mv_q2",
            Kernel::MvQ2g64 => "mv_q2g64",
            Kernel::MvF32 => "mv_f32",
            Kernel::Swiglu => "swiglu",
            Kernel::GdnConv => "gdn_conv",
            Kernel::GdnPrep => "gdn_prep",
            Kernel::GdnStep => "gdn_step",
            Kernel::AttnPrep => "attn_prep",
            Kernel::Attn => "attn",
            Kernel::QuantQ8 => "quant_q8",
            Kernel::MvDotQ1 => "mv_dot_q1",
            Kernel::MvDotQ2 => "mv_dot_q2",
            Kernel::MvDotQ2g64 => "mv_dot_q2g64",
            Kernel::RmsnormQ8 => "rmsnorm_q8",
        }
    }
    /// Whether the shader uses packed int8 dot products (built only where the device has them).
    pub fn needs_int_dot(self) -> bool {
        matches!(self, Kernel::MvDotQ1 | Kernel::MvDotQ2 | Kernel::MvDotQ2g64)
    }
}

/// Workgroups of a mat-vec dispatch (`mv_*`): 4 outputs of one activation row each.
pub fn mv_groups(n_out: usize, n: usize) -> u32 {
    (n * n_out.div_ceil(4)) as u32
}

/// Outputs per workgroup of the int8-activation mat-vec (`mv_dot.comp`'s ROWS).
pub const MV_DOT_ROWS: usize = 4;

/// Workgroups of an int8-activation mat-vec dispatch (`mv_dot_*`; its push constants carry the
/// activation row count `n`, and workgroups past `ceil(n_out / ROWS) · n` return at once).
pub fn mv_dot_groups(n_out: usize, n: usize) -> u32 {
    (n * n_out.div_ceil(MV_DOT_ROWS)) as u32
}

/// 32-element blocks per padded activation row of `width` for `quant_q8` / `mv_dot_*`: the row is
/// padded with zero blocks to a multiple of 256 elements, as the CPU engine pads it.
pub fn q8_blocks(width: usize) -> usize {
    width.div_ceil(256) * 8
}

/// Workgroups of a `quant_q8` dispatch over `n` rows of `width`.
pub fn quant_q8_groups(n: usize, width: usize) -> u32 {
    (n * q8_blocks(width)).div_ceil(128) as u32
}

/// Workgroups of a `gdn_step` dispatch: 32 value columns of one v-head each.
pub fn gdn_step_groups(hv: usize, dv: usize) -> u32 {
    (hv * dv.div_ceil(32)) as u32
}

/// The largest d_k `gdn_step` takes (its state column lives in registers, d_k / 4 per invocation);
/// d_k must also be a multiple of 4.
pub const GDN_MAX_DK: usize = 128;

/// A physical device as the loader reports it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    /// "discrete", "integrated", "virtual", "cpu" or "other".
    pub kind: &'static str,
    pub api: (u32, u32, u32),
    /// Nanoseconds per timestamp tick, and whether the compute queue writes timestamps.
    pub timestamp_period: f32,
    pub timestamps: bool,
    /// `shaderIntegerDotProduct` (Vulkan 1.3 or VK_KHR_shader_integer_dot_product): the device
    /// runs the int8-activation kernels (`quant_q8`, `mv_dot_*`); enabled at device creation.
    pub int_dot: bool,
    /// The driver says signed × unsigned packed 4×8 dot products are accelerated (a GPU
    /// instruction, not an emulation): the backend's default picks the int8 kernels then.
    pub int_dot_fast: bool,
}

struct Exec {
    pool: vk::CommandPool,
    cb: vk::CommandBuffer,
    fence: vk::Fence,
    /// Host-visible bounce buffer for uploads and downloads, grown on demand.
    staging: Option<Buffer>,
    /// `cb` is recording commands not yet submitted ([`Vulkan::record`]).
    pending: bool,
    /// GPU time per kernel (`BONSAI_VK_PROFILE=1`).
    prof: Option<Prof>,
}

/// Timestamps around every dispatch of a command buffer, summed per kernel when it has run.
struct Prof {
    pool: vk::QueryPool,
    /// (what, first of its two queries) for this command buffer's profiled commands.
    marks: Vec<(usize, u32)>,
    /// count and nanoseconds per `Kernel::ALL` index, then one slot for copies / updates / fills.
    total: Vec<(u64, f64)>,
    period_ns: f64,
    /// `BONSAI_VK_PROFILE=<path>`: the table is rewritten there at most twice a second (and at
    /// the end), for processes that never drop their context.
    file: Option<String>,
    written: Option<std::time::Instant>,
    /// Submissions and the host time spent in them (submit to fence signalled).
    submits: u64,
    submit_ns: f64,
}

const PROF_QUERIES: u32 = 1 << 14;
const PROF_OTHER: usize = Kernel::ALL.len();

impl Prof {
    /// Read back the finished command buffer's timestamps and add them up.
    fn collect(&mut self, d: &ash::Device) {
        let n = self.marks.len() as u32 * 2;
        if n == 0 {
            return;
        }
        let mut ts = vec![0u64; n as usize];
        // SAFETY: the queries 0..n were reset and written by the command buffer that was just
        // waited for; `ts` holds n 64-bit results.
        let ok = unsafe {
            d.get_query_pool_results(
                self.pool,
                0,
                &mut ts,
                vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WAIT,
            )
        };
        if ok.is_ok() {
            for &(k, q) in &self.marks {
                let dt = ts[q as usize + 1].wrapping_sub(ts[q as usize]) as f64 * self.period_ns;
                self.total[k].0 += 1;
                self.total[k].1 += dt;
            }
        }
        self.marks.clear();
        self.write(false);
    }

    fn write(&mut self, last: bool) {
        if let Some(f) = &self.file {
            if last
                || self
                    .written
                    .is_none_or(|w| w.elapsed().as_secs_f64() >= 0.5)
            {
                let _ = std::fs::write(f, self.report());
                self.written = Some(std::time::Instant::now());
            }
        }
    }

    fn report(&self) -> String {
        let mut r = prof_report(&self.total);
        r += &format!(
            "  submissions {:>10} x {:>10.3} ms {:>9.2} us each (host: submit to fence)\n",
            self.submits,
            self.submit_ns / 1e6,
            self.submit_ns / 1e3 / self.submits.max(1) as f64
        );
        r
    }
}

/// Begin recording into `ex.cb` unless it already is.
fn begin(inner: &Inner, ex: &mut Exec) -> Result<()> {
    if ex.pending {
        return Ok(());
    }
    let d = &inner.device;
    // SAFETY: the command buffer is not in flight: every submission waits for its fence before
    // `pending` is cleared, under the Exec lock.
    unsafe {
        d.reset_command_buffer(ex.cb, vk::CommandBufferResetFlags::empty())
            .map_err(vkerr("reset command buffer"))?;
        d.begin_command_buffer(
            ex.cb,
            &vk::CommandBufferBeginInfo::default()
                .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
        )
        .map_err(vkerr("begin command buffer"))?;
        if let Some(p) = &ex.prof {
            d.cmd_reset_query_pool(ex.cb, p.pool, 0, PROF_QUERIES);
        }
    }
    ex.pending = true;
    Ok(())
}

/// Submit what `ex.cb` recorded and wait for it (nothing when nothing is pending).
fn flush_exec(inner: &Inner, ex: &mut Exec) -> Result<()> {
    if !ex.pending {
        return Ok(());
    }
    ex.pending = false;
    let d = &inner.device;
    let t0 = std::time::Instant::now();
    // SAFETY: cb is in the recording state (pending); end, submit, wait, reset the fence.
    unsafe {
        // the host reads downloads after the fence: make every write visible to it
        let mb = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ)];
        d.cmd_pipeline_barrier(
            ex.cb,
            vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
            vk::PipelineStageFlags::HOST,
            vk::DependencyFlags::empty(),
            &mb,
            &[],
            &[],
        );
        d.end_command_buffer(ex.cb)
            .map_err(vkerr("end command buffer"))?;
        let cbs = [ex.cb];
        let si = [vk::SubmitInfo::default().command_buffers(&cbs)];
        d.queue_submit(inner.queue, &si, ex.fence)
            .map_err(vkerr("queue submit"))?;
        let w = d.wait_for_fences(&[ex.fence], true, u64::MAX);
        d.reset_fences(&[ex.fence]).map_err(vkerr("reset fence"))?;
        w.map_err(vkerr("wait for the GPU"))?;
    }
    if let Some(p) = &mut ex.prof {
        p.submits += 1;
        p.submit_ns += t0.elapsed().as_secs_f64() * 1e9;
        p.collect(d);
    }
    Ok(())
}

struct Inner {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    queue: vk::Queue,
    mem: vk::PhysicalDeviceMemoryProperties,
    layout: vk::PipelineLayout,
    pipelines: Vec<vk::Pipeline>, // indexed like Kernel::ALL
    info: DeviceInfo,
    exec: Mutex<Option<Exec>>,
    /// `BONSAI_VK_BARRIER_HOST=1` (A/B): every barrier also to the host stage, the behaviour
    /// before the host was made to see the writes once, at the end of a command buffer.
    barrier_host: bool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: every Buffer holds an Arc<Inner>, so none is alive; the queue is idle after
        // device_wait_idle, and each handle is destroyed once, children before the device.
        unsafe {
            let _ = self.device.device_wait_idle();
            if let Some(mut ex) = self.exec.get_mut().ok().and_then(|e| e.take()) {
                if let Some(mut p) = ex.prof.take() {
                    p.write(true);
                    eprintln!("{}", p.report());
                    self.device.destroy_query_pool(p.pool, None);
                }
                drop(ex.staging);
                self.device.destroy_fence(ex.fence, None);
                self.device.destroy_command_pool(ex.pool, None);
            }
            for &p in &self.pipelines {
                self.device.destroy_pipeline(p, None);
            }
            self.device.destroy_pipeline_layout(self.layout, None);
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// A device buffer of `size` bytes with its device address.
pub struct Buffer {
    inner: Arc<Inner>,
    buf: vk::Buffer,
    mem: vk::DeviceMemory,
    size: u64,
    addr: u64,
    host_visible: bool,
}

impl Buffer {
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // Recorded but unsubmitted commands may use this buffer: run them first. (When the Exec
        // lock is held, by the staging-buffer swap, the holder has flushed already.)
        if let Ok(mut g) = self.inner.exec.try_lock() {
            if let Some(ex) = g.as_mut() {
                let _ = flush_exec(&self.inner, ex);
            }
        }
        // SAFETY: the buffer and its memory were created on this device and are destroyed once;
        // every submission is waited for, and pending commands were just flushed, so no work
        // still uses them.
        unsafe {
            self.inner.device.destroy_buffer(self.buf, None);
            self.inner.device.free_memory(self.mem, None);
        }
    }
}

/// The Vulkan context: one device, one compute queue, every pipeline built.
#[derive(Clone)]
pub struct Vulkan {
    inner: Arc<Inner>,
}

fn kind_name(t: vk::PhysicalDeviceType) -> &'static str {
    match t {
        vk::PhysicalDeviceType::DISCRETE_GPU => "discrete",
        vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated",
        vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual",
        vk::PhysicalDeviceType::CPU => "cpu",
        _ => "other",
    }
}

fn kind_rank(k: &str) -> u32 {
    match k {
        "discrete" => 0,
        "integrated" => 1,
        "virtual" => 2,
        "other" => 3,
        _ => 4,
    }
}

fn load_entry() -> Result<ash::Entry> {
    // SAFETY: dlopens the system Vulkan loader; ash checks the symbols it resolves.
    unsafe { ash::Entry::load() }
        .map_err(|e| VkError(format!("no Vulkan loader (libvulkan.so.1): {e}")))
}

fn new_instance(entry: &ash::Entry) -> Result<ash::Instance> {
    let app = vk::ApplicationInfo::default()
        .application_name(c"bonsai")
        .api_version(vk::make_api_version(0, 1, 2, 0));
    let ci = vk::InstanceCreateInfo::default().application_info(&app);
    // SAFETY: the create info and what it points to outlive the call.
    unsafe { entry.create_instance(&ci, None) }.map_err(vkerr("create instance"))
}

/// The usable physical devices, best first (discrete > integrated > virtual > other > CPU), each
/// with Vulkan ≥ 1.2 and bufferDeviceAddress.
fn usable_devices(instance: &ash::Instance) -> Result<Vec<(vk::PhysicalDevice, DeviceInfo, u32)>> {
    // SAFETY: plain queries on a live instance.
    let pds =
        unsafe { instance.enumerate_physical_devices() }.map_err(vkerr("enumerate devices"))?;
    let mut out = Vec::new();
    for pd in pds {
        // SAFETY: queries on a physical device the instance returned.
        let (props, queues) = unsafe {
            (
                instance.get_physical_device_properties(pd),
                instance.get_physical_device_queue_family_properties(pd),
            )
        };
        let api = props.api_version;
        let api = (
            vk::api_version_major(api),
            vk::api_version_minor(api),
            vk::api_version_patch(api),
        );
        if api < (1, 2, 0) {
            continue;
        }
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f12);
        // SAFETY: f2 chains f12, both live across the call.
        unsafe { instance.get_physical_device_features2(pd, &mut f2) };
        if f12.buffer_device_address == vk::FALSE {
            continue;
        }
        let Some(family) = queues
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
        else {
            continue;
        };
        // Packed int8 dot products: the instance asks for Vulkan 1.2, so they come from the
        // extension even on a 1.3 device.
        // SAFETY: a query on a physical device the instance returned.
        let has_dot_ext = unsafe { instance.enumerate_device_extension_properties(pd) }
            .map(|exts| {
                exts.iter().any(|e| {
                    e.extension_name_as_c_str().ok()
                        == Some(ash::khr::shader_integer_dot_product::NAME)
                })
            })
            .unwrap_or(false);
        let (mut int_dot, mut int_dot_fast) = (false, false);
        if has_dot_ext {
            let mut fd = vk::PhysicalDeviceShaderIntegerDotProductFeatures::default();
            let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut fd);
            // SAFETY: f2 chains fd, both live across the call; the extension is present.
            unsafe { instance.get_physical_device_features2(pd, &mut f2) };
            int_dot = fd.shader_integer_dot_product != vk::FALSE;
            let mut pdp = vk::PhysicalDeviceShaderIntegerDotProductProperties::default();
            let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut pdp);
            // SAFETY: as above.
            unsafe { instance.get_physical_device_properties2(pd, &mut p2) };
            int_dot_fast = int_dot
                && pdp.integer_dot_product4x8_bit_packed_mixed_signedness_accelerated != vk::FALSE;
        }
        let name = props
            .device_name_as_c_str()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "?".into());
        out.push((
            pd,
            DeviceInfo {
                name,
                kind: kind_name(props.device_type),
                api,
                timestamp_period: props.limits.timestamp_period,
                timestamps: queues[family].timestamp_valid_bits > 0
                    && props.limits.timestamp_period > 0.0,
                int_dot,
                int_dot_fast,
            },
            family as u32,
        ));
    }
    out.sort_by_key(|(_, i, _)| kind_rank(i.kind));
    Ok(out)
}

impl Vulkan {
    /// The usable devices, best first; empty (not an error) when the loader finds none.
    pub fn devices() -> Result<Vec<DeviceInfo>> {
        let entry = load_entry()?;
        let instance = new_instance(&entry)?;
        let r = usable_devices(&instance);
        // SAFETY: nothing created from this instance is alive.
        unsafe { instance.destroy_instance(None) };
        Ok(r?.into_iter().map(|(_, i, _)| i).collect())
    }

    /// Whether a usable non-CPU device exists (what `device="auto"` asks: a software rasterizer
    /// such as llvmpipe is never picked automatically).
    pub fn gpu_available() -> bool {
        Self::devices().is_ok_and(|d| d.iter().any(|i| i.kind != "cpu"))
    }

    /// Open the best usable device. `allow_cpu` also accepts a CPU implementation (lavapipe), which
    /// is what the tests run on where there is no GPU.
    pub fn new(allow_cpu: bool) -> Result<Vulkan> {
        let entry = load_entry()?;
        let instance = new_instance(&entry)?;
        let picked = usable_devices(&instance).and_then(|devs| {
            devs.into_iter()
                .find(|(_, i, _)| allow_cpu || i.kind != "cpu")
                .ok_or_else(|| {
                    VkError(
                        "no Vulkan GPU with Vulkan 1.2 and bufferDeviceAddress (a CPU \
                         implementation such as llvmpipe is not used unless asked for)"
                            .into(),
                    )
                })
        });
        let (pd, info, family) = match picked {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: nothing created from this instance is alive.
                unsafe { instance.destroy_instance(None) };
                return Err(e);
            }
        };
        let prio = [1.0f32];
        let qci = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(family)
            .queue_priorities(&prio)];
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default().buffer_device_address(true);
        let mut fdot = vk::PhysicalDeviceShaderIntegerDotProductFeatures::default()
            .shader_integer_dot_product(true);
        let dot_ext = [ash::khr::shader_integer_dot_product::NAME.as_ptr()];
        let mut dci = vk::DeviceCreateInfo::default()
            .queue_create_infos(&qci)
            .push_next(&mut f12);
        if info.int_dot {
            dci = dci.enabled_extension_names(&dot_ext).push_next(&mut fdot);
        }
        // SAFETY: pd belongs to this instance; the create infos outlive the call.
        let device = match unsafe { instance.create_device(pd, &dci, None) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: as above.
                unsafe { instance.destroy_instance(None) };
                return Err(vkerr("create device")(e));
            }
        };
        // SAFETY: queries on live handles.
        let (queue, mem) = unsafe {
            (
                device.get_device_queue(family, 0),
                instance.get_physical_device_memory_properties(pd),
            )
        };
        let ranges = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .offset(0)
            .size(128)];
        let lci = vk::PipelineLayoutCreateInfo::default().push_constant_ranges(&ranges);
        // SAFETY: a layout with one push-constant range and no sets, on a live device.
        let layout = unsafe { device.create_pipeline_layout(&lci, None) };
        let mut inner = Inner {
            _entry: entry,
            instance,
            device,
            queue,
            mem,
            layout: vk::PipelineLayout::null(),
            pipelines: Vec::new(),
            info,
            exec: Mutex::new(None),
            barrier_host: std::env::var("BONSAI_VK_BARRIER_HOST").as_deref() == Ok("1"),
        };
        // From here on Inner's Drop releases whatever was created.
        inner.layout = layout.map_err(vkerr("create pipeline layout"))?;
        for k in Kernel::ALL {
            // the int8 kernels exist only where the device has packed dot products
            let p = if k.needs_int_dot() && !inner.info.int_dot {
                vk::Pipeline::null()
            } else {
                build_pipeline(&inner.device, inner.layout, k)?
            };
            inner.pipelines.push(p);
        }
        let pool_ci = vk::CommandPoolCreateInfo::default()
            .queue_family_index(family)
            .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
        // SAFETY: live device; the pool, its buffer and the fence are owned by Exec and destroyed
        // in Inner's Drop.
        unsafe {
            let pool = inner
                .device
                .create_command_pool(&pool_ci, None)
                .map_err(vkerr("create command pool"))?;
            let ai = vk::CommandBufferAllocateInfo::default()
                .command_pool(pool)
                .level(vk::CommandBufferLevel::PRIMARY)
                .command_buffer_count(1);
            let cb = match inner.device.allocate_command_buffers(&ai) {
                Ok(v) => v[0],
                Err(e) => {
                    inner.device.destroy_command_pool(pool, None);
                    return Err(vkerr("allocate command buffer")(e));
                }
            };
            let fence = match inner
                .device
                .create_fence(&vk::FenceCreateInfo::default(), None)
            {
                Ok(f) => f,
                Err(e) => {
                    inner.device.destroy_command_pool(pool, None);
                    return Err(vkerr("create fence")(e));
                }
            };
            let prof_env = std::env::var("BONSAI_VK_PROFILE").unwrap_or_default();
            let prof = if !prof_env.is_empty() && prof_env != "0" && inner.info.timestamps {
                let qci = vk::QueryPoolCreateInfo::default()
                    .query_type(vk::QueryType::TIMESTAMP)
                    .query_count(PROF_QUERIES);
                inner
                    .device
                    .create_query_pool(&qci, None)
                    .ok()
                    .map(|qp| Prof {
                        pool: qp,
                        marks: Vec::new(),
                        total: vec![(0, 0.0); PROF_OTHER + 1],
                        period_ns: f64::from(inner.info.timestamp_period),
                        file: (prof_env != "1").then(|| prof_env.clone()),
                        written: None,
                        submits: 0,
                        submit_ns: 0.0,
                    })
            } else {
                None
            };
            *inner.exec.get_mut().unwrap() = Some(Exec {
                pool,
                cb,
                fence,
                staging: None,
                pending: false,
                prof,
            });
        }
        Ok(Vulkan {
            inner: Arc::new(inner),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// "NVIDIA H200 (discrete, Vulkan 1.3.x)".
    pub fn name(&self) -> String {
        let i = &self.inner.info;
        format!(
            "{} ({}, Vulkan {}.{}.{})",
            i.name, i.kind, i.api.0, i.api.1, i.api.2
        )
    }

    fn memory_type(&self, bits: u32, want: vk::MemoryPropertyFlags) -> Option<u32> {
        let m = &self.inner.mem;
        (0..m.memory_type_count).find(|&i| {
            bits & (1 << i) != 0 && m.memory_types[i as usize].property_flags.contains(want)
        })
    }

    fn create_buffer(&self, size: u64, host: bool) -> Result<Buffer> {
        let size = size.max(4).next_multiple_of(4);
        let d = &self.inner.device;
        let bci = vk::BufferCreateInfo::default().size(size).usage(
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST
                | vk::BufferUsageFlags::SHADER_DEVICE_ADDRESS,
        );
        // SAFETY: live device; the buffer is freed by Buffer's Drop or below on failure.
        let buf = unsafe { d.create_buffer(&bci, None) }.map_err(vkerr("create buffer"))?;
        // SAFETY: buf is live.
        let req = unsafe { d.get_buffer_memory_requirements(buf) };
        let want = if host {
            vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT
        } else {
            vk::MemoryPropertyFlags::DEVICE_LOCAL
        };
        let Some(ti) = self
            .memory_type(req.memory_type_bits, want)
            .or_else(|| self.memory_type(req.memory_type_bits, vk::MemoryPropertyFlags::empty()))
        else {
            // SAFETY: buf is live and unused.
            unsafe { d.destroy_buffer(buf, None) };
            return Err(VkError(
                "vulkan: no memory type for a storage buffer".into(),
            ));
        };
        let host_visible = self.inner.mem.memory_types[ti as usize]
            .property_flags
            .contains(
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
            );
        let mut flags =
            vk::MemoryAllocateFlagsInfo::default().flags(vk::MemoryAllocateFlags::DEVICE_ADDRESS);
        let ai = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(ti)
            .push_next(&mut flags);
        // SAFETY: live device, valid allocate info; on failure buf is destroyed.
        let mem = match unsafe { d.allocate_memory(&ai, None) } {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: buf is live and unused.
                unsafe { d.destroy_buffer(buf, None) };
                return Err(VkError(format!(
                    "vulkan: cannot allocate {size} bytes of {} memory: {e}",
                    if host { "host-visible" } else { "device" }
                )));
            }
        };
        // SAFETY: mem was allocated for buf's requirements; the address query needs the binding.
        let addr = unsafe {
            if let Err(e) = d.bind_buffer_memory(buf, mem, 0) {
                d.destroy_buffer(buf, None);
                d.free_memory(mem, None);
                return Err(vkerr("bind buffer memory")(e));
            }
            d.get_buffer_device_address(&vk::BufferDeviceAddressInfo::default().buffer(buf))
        };
        Ok(Buffer {
            inner: self.inner.clone(),
            buf,
            mem,
            size,
            addr,
            host_visible,
        })
    }

    /// A zero-filled device buffer of `bytes` bytes.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        let b = self.create_buffer(bytes, false)?;
        self.run(|c| {
            c.fill(&b, 0, b.size, 0);
            Ok(())
        })?;
        Ok(b)
    }

    fn with_exec<T>(&self, f: impl FnOnce(&mut Exec) -> Result<T>) -> Result<T> {
        let mut g = self
            .inner
            .exec
            .lock()
            .map_err(|_| VkError("vulkan: a previous submission panicked".into()))?;
        let ex = g.as_mut().expect("Exec is set up in Vulkan::new");
        f(ex)
    }

    /// Record `f`'s commands, then submit everything pending and wait for it.
    pub fn run(&self, f: impl FnOnce(&mut Cmd) -> Result<()>) -> Result<()> {
        self.with_exec(|ex| self.submit(ex, f))
    }

    /// Append `f`'s commands to the pending command buffer without submitting: they run at the
    /// next [`Vulkan::flush`], `run`, upload, download, or when a buffer is dropped. So a whole
    /// decode step is one submission. If `f` fails, what is pending is submitted and the error
    /// returned.
    pub fn record(&self, f: impl FnOnce(&mut Cmd) -> Result<()>) -> Result<()> {
        self.with_exec(|ex| {
            let r = self.append(ex, f);
            if r.is_err() {
                let fl = flush_exec(&self.inner, ex);
                r?;
                fl?;
            }
            Ok(())
        })
    }

    /// Submit the pending commands and wait for them.
    pub fn flush(&self) -> Result<()> {
        self.with_exec(|ex| flush_exec(&self.inner, ex))
    }

    /// Begin recording unless pending, then record `f`'s commands into `ex.cb` (not submitted).
    fn append(&self, ex: &mut Exec, f: impl FnOnce(&mut Cmd) -> Result<()>) -> Result<()> {
        begin(&self.inner, ex)?;
        f(&mut Cmd {
            inner: &self.inner,
            cb: ex.cb,
            prof: ex.prof.as_mut(),
        })
    }

    fn submit(&self, ex: &mut Exec, f: impl FnOnce(&mut Cmd) -> Result<()>) -> Result<()> {
        let r = self.append(ex, f);
        let fl = flush_exec(&self.inner, ex);
        r?;
        fl
    }

    fn staging(&self, ex: &mut Exec, bytes: u64) -> Result<()> {
        if ex.staging.as_ref().is_none_or(|s| s.size < bytes) {
            ex.staging = None;
            ex.staging = Some(self.create_buffer(bytes.next_power_of_two().max(1 << 16), true)?);
        }
        Ok(())
    }

    /// Copy `data` into `dst` at byte `off`.
    pub fn upload(&self, dst: &Buffer, off: u64, data: &[u8]) -> Result<()> {
        check_range(dst, off, data.len() as u64, "upload")?;
        const CHUNK: usize = 64 << 20;
        self.with_exec(|ex| {
            flush_exec(&self.inner, ex)?;
            for (i, part) in data.chunks(CHUNK).enumerate() {
                self.staging(ex, part.len() as u64)?;
                let st = ex.staging.as_ref().unwrap();
                map_copy(st, |p| p[..part.len()].copy_from_slice(part))?;
                let (src_buf, dst_buf) = (st.buf, dst.buf);
                let at = off + (i * CHUNK) as u64;
                let len = part.len() as u64;
                self.submit(ex, |c| {
                    c.copy_raw(src_buf, 0, dst_buf, at, len);
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    /// Copy `out.len()` bytes of `src` from byte `off`.
    pub fn download(&self, src: &Buffer, off: u64, out: &mut [u8]) -> Result<()> {
        check_range(src, off, out.len() as u64, "download")?;
        const CHUNK: usize = 64 << 20;
        self.with_exec(|ex| {
            flush_exec(&self.inner, ex)?;
            for (i, part) in out.chunks_mut(CHUNK).enumerate() {
                self.staging(ex, part.len() as u64)?;
                let st_buf = ex.staging.as_ref().unwrap().buf;
                let at = off + (i * CHUNK) as u64;
                let len = part.len() as u64;
                let src_buf = src.buf;
                self.submit(ex, |c| {
                    c.copy_raw(src_buf, at, st_buf, 0, len);
                    Ok(())
                })?;
                map_copy(ex.staging.as_ref().unwrap(), |p| {
                    part.copy_from_slice(&p[..part.len()])
                })?;
            }
            Ok(())
        })
    }

    pub fn upload_f32(&self, dst: &Buffer, off_elems: usize, v: &[f32]) -> Result<()> {
        self.upload(dst, 4 * off_elems as u64, f32_bytes(v))
    }

    pub fn download_f32(&self, src: &Buffer, off_elems: usize, out: &mut [f32]) -> Result<()> {
        // SAFETY: f32 has no invalid bit patterns and u8 has alignment 1; the slice covers exactly
        // out's memory.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                out.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(out),
            )
        };
        self.download(src, 4 * off_elems as u64, bytes)
    }

    /// A device buffer holding `v`.
    pub fn buffer_f32(&self, v: &[f32]) -> Result<Buffer> {
        let b = self.create_buffer(4 * v.len() as u64, false)?;
        if !v.is_empty() {
            self.upload_f32(&b, 0, v)?;
        }
        Ok(b)
    }

    /// A device buffer holding `v`.
    pub fn buffer_u32(&self, v: &[u32]) -> Result<Buffer> {
        let b = self.create_buffer(4 * v.len() as u64, false)?;
        if !v.is_empty() {
            // SAFETY: u32 → bytes over exactly v's memory.
            let bytes = unsafe {
                std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
            };
            self.upload(&b, 0, bytes)?;
        }
        Ok(b)
    }
}

/// `v` as bytes.
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 plain bytes; the slice covers exactly v's memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// The profiler's table: kernel, dispatches, total ms, µs per dispatch, share; most time first.
fn prof_report(total: &[(u64, f64)]) -> String {
    let all: f64 = total.iter().map(|t| t.1).sum();
    let mut rows: Vec<(usize, u64, f64)> = total
        .iter()
        .enumerate()
        .filter(|(_, t)| t.0 > 0)
        .map(|(i, t)| (i, t.0, t.1))
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    let mut out = format!(
        "vulkan profile (BONSAI_VK_PROFILE=1): {:.3} ms of GPU time in timed commands\n",
        all / 1e6
    );
    for (i, n, ns) in rows {
        let name = Kernel::ALL
            .get(i)
            .map_or("copy/update/fill", |k| k.module());
        out += &format!(
            "  {name:<18} {n:>8} x {:>10.3} ms {:>9.2} us each {:>5.1} %\n",
            ns / 1e6,
            ns / 1e3 / n as f64,
            100.0 * ns / all.max(1.0)
        );
    }
    out
}

fn check_range(b: &Buffer, off: u64, len: u64, what: &str) -> Result<()> {
    if off.checked_add(len).is_none_or(|end| end > b.size) {
        return Err(VkError(format!(
            "vulkan: {what} of {len} bytes at {off} outside a {}-byte buffer",
            b.size
        )));
    }
    Ok(())
}

/// Map a host-visible buffer and give `f` its bytes.
fn map_copy(b: &Buffer, f: impl FnOnce(&mut [u8])) -> Result<()> {
    debug_assert!(b.host_visible);
    let d = &b.inner.device;
    // SAFETY: the staging buffer is host-visible and coherent, no submitted work touches it while
    // the Exec lock is held and its last submission was waited for; the mapping covers `size`.
    unsafe {
        let p = d
            .map_memory(b.mem, 0, b.size, vk::MemoryMapFlags::empty())
            .map_err(vkerr("map memory"))?;
        f(std::slice::from_raw_parts_mut(
            p.cast::<u8>(),
            b.size as usize,
        ));
        d.unmap_memory(b.mem);
    }
    Ok(())
}

fn build_pipeline(d: &ash::Device, layout: vk::PipelineLayout, k: Kernel) -> Result<vk::Pipeline> {
    // A/B of shader variants without a rebuild: BONSAI_VK_SPV_DIR/<module>.spv, where present,
    // replaces the embedded module.
    let over = std::env::var("BONSAI_VK_SPV_DIR").ok().and_then(|dir| {
        std::fs::read(std::path::Path::new(&dir).join(format!("{}.spv", k.module()))).ok()
    });
    let bytes: &[u8] = match &over {
        Some(b) if b.len() % 4 == 0 => b,
        _ => spirv::MODULES
            .iter()
            .find(|(n, _)| *n == k.module())
            .map(|(_, b)| *b)
            .ok_or_else(|| VkError(format!("vulkan: no SPIR-V module {}", k.module())))?,
    };
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let smci = vk::ShaderModuleCreateInfo::default().code(&words);
    // SAFETY: words is a SPIR-V module built by glslc for Vulkan 1.2; the module is destroyed
    // right after the pipeline is built from it.
    unsafe {
        let m = d
            .create_shader_module(&smci, None)
            .map_err(vkerr("create shader module"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(m)
            .name(c"main");
        let ci = [vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(layout)];
        let r = d.create_compute_pipelines(vk::PipelineCache::null(), &ci, None);
        d.destroy_shader_module(m, None);
        match r {
            Ok(p) => Ok(p[0]),
            Err((_, e)) => Err(VkError(format!(
                "vulkan: build pipeline {}: {e}",
                k.module()
            ))),
        }
    }
}

/// A command buffer being recorded ([`Vulkan::run`]). Every command is followed by a full memory
/// barrier, so each dispatch sees everything the commands before it wrote.
pub struct Cmd<'a> {
    inner: &'a Inner,
    cb: vk::CommandBuffer,
    prof: Option<&'a mut Prof>,
}

impl Cmd<'_> {
    /// With the profiler on: a timestamp before the command `what` (`Kernel::ALL` index, or
    /// `PROF_OTHER`); `mark_end` writes the one after it. Past the pool's size nothing is timed.
    fn mark_begin(&mut self, what: usize) -> bool {
        let Some(p) = self.prof.as_mut() else {
            return false;
        };
        let q = p.marks.len() as u32 * 2;
        if q + 2 > PROF_QUERIES {
            return false;
        }
        p.marks.push((what, q));
        // SAFETY: recording state; query q of the pool was reset at the buffer's begin.
        unsafe {
            self.inner.device.cmd_write_timestamp(
                self.cb,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                p.pool,
                q,
            )
        };
        true
    }

    fn mark_end(&mut self, on: bool) {
        if !on {
            return;
        }
        let p = self.prof.as_mut().expect("mark_begin saw the profiler");
        let q = p.marks.last().expect("mark_begin pushed a mark").1 + 1;
        // SAFETY: as in mark_begin; query q (< PROF_QUERIES) was reset at the buffer's begin.
        unsafe {
            self.inner.device.cmd_write_timestamp(
                self.cb,
                vk::PipelineStageFlags::BOTTOM_OF_PIPE,
                p.pool,
                q,
            )
        };
    }

    /// Everything recorded so far (compute and transfer) is visible to everything after. The
    /// stages are the two this context uses, not ALL_COMMANDS, so a driver need not drain more.
    fn barrier(&mut self) {
        let (st, wr, rd) = (
            vk::PipelineStageFlags::COMPUTE_SHADER | vk::PipelineStageFlags::TRANSFER,
            vk::AccessFlags::SHADER_WRITE | vk::AccessFlags::TRANSFER_WRITE,
            vk::AccessFlags::SHADER_READ | vk::AccessFlags::TRANSFER_READ,
        );
        // the host sees the writes through the barrier flush_exec records at the end (on the
        // H200 a dispatch and its barrier took ~1.5 µs less without the host stage)
        let (host_st, host_rd) = if self.inner.barrier_host {
            (vk::PipelineStageFlags::HOST, vk::AccessFlags::HOST_READ)
        } else {
            (vk::PipelineStageFlags::empty(), vk::AccessFlags::empty())
        };
        let mb = [vk::MemoryBarrier::default()
            .src_access_mask(wr)
            .dst_access_mask(rd | wr | host_rd)];
        // SAFETY: recording into a command buffer in the recording state.
        unsafe {
            self.inner.device.cmd_pipeline_barrier(
                self.cb,
                st,
                st | host_st,
                vk::DependencyFlags::empty(),
                &mb,
                &[],
                &[],
            )
        };
    }

    /// Run `k` over `groups` workgroups (laid out as x ≤ 65535 by y; the shader reads the count
    /// from its push constants and returns past it).
    pub fn dispatch(&mut self, k: Kernel, groups: u32, push: &Push) {
        if groups == 0 {
            return;
        }
        let idx = Kernel::ALL.iter().position(|&x| x == k).unwrap();
        assert!(
            self.inner.pipelines[idx] != vk::Pipeline::null(),
            "vulkan: {} dispatched on a device without packed int8 dot products",
            k.module()
        );
        let timed = self.mark_begin(idx);
        let (gx, gy) = if groups <= 65535 {
            (groups, 1)
        } else {
            (65535, groups.div_ceil(65535))
        };
        // SAFETY: recording state; the pipeline and layout belong to this device; the push bytes
        // fit the layout's 128-byte range.
        unsafe {
            let d = &self.inner.device;
            d.cmd_bind_pipeline(
                self.cb,
                vk::PipelineBindPoint::COMPUTE,
                self.inner.pipelines[idx],
            );
            d.cmd_push_constants(
                self.cb,
                self.inner.layout,
                vk::ShaderStageFlags::COMPUTE,
                0,
                push.as_bytes(),
            );
            d.cmd_dispatch(self.cb, gx, gy, 1);
        }
        self.barrier();
        self.mark_end(timed);
    }

    fn copy_raw(&mut self, src: vk::Buffer, so: u64, dst: vk::Buffer, dof: u64, len: u64) {
        if len == 0 {
            return;
        }
        let r = [vk::BufferCopy::default()
            .src_offset(so)
            .dst_offset(dof)
            .size(len)];
        let timed = self.mark_begin(PROF_OTHER);
        // SAFETY: recording state; the ranges were checked by the callers.
        unsafe { self.inner.device.cmd_copy_buffer(self.cb, src, dst, &r) };
        self.barrier();
        self.mark_end(timed);
    }

    /// `dst[dof ..] ← src[so ..]`, `len` bytes (multiples of 4 not required).
    pub fn copy(&mut self, src: &Buffer, so: u64, dst: &Buffer, dof: u64, len: u64) -> Result<()> {
        check_range(src, so, len, "copy source")?;
        check_range(dst, dof, len, "copy destination")?;
        self.copy_raw(src.buf, so, dst.buf, dof, len);
        Ok(())
    }

    /// Write `data` (a multiple of 4 bytes) into `dst` at byte `off` from inside the command
    /// buffer (`vkCmdUpdateBuffer`, 64 KiB per command), ordered with the other commands.
    pub fn update(&mut self, dst: &Buffer, off: u64, data: &[u8]) -> Result<()> {
        check_range(dst, off, data.len() as u64, "update")?;
        if off % 4 != 0 || data.len() % 4 != 0 {
            return Err(VkError(format!(
                "vulkan: update of {} bytes at {off}: not 4-byte aligned",
                data.len()
            )));
        }
        let timed = self.mark_begin(PROF_OTHER);
        for (i, part) in data.chunks(65536).enumerate() {
            // SAFETY: recording state; the range was checked and is 4-byte aligned, ≤ 64 KiB.
            unsafe {
                self.inner.device.cmd_update_buffer(
                    self.cb,
                    dst.buf,
                    off + (i * 65536) as u64,
                    part,
                )
            };
        }
        self.barrier();
        self.mark_end(timed);
        Ok(())
    }

    /// Fill `len` bytes (a multiple of 4) of `dst` from `off` with the word `word`.
    pub fn fill(&mut self, dst: &Buffer, off: u64, len: u64, word: u32) {
        if len == 0 {
            return;
        }
        let timed = self.mark_begin(PROF_OTHER);
        // SAFETY: recording state; the range lies inside the buffer (callers pass sizes of it).
        unsafe {
            self.inner
                .device
                .cmd_fill_buffer(self.cb, dst.buf, off, len, word)
        };
        self.barrier();
        self.mark_end(timed);
    }
}
