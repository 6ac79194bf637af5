//! Parallel loops of the forward pass, and the spinning thread pool they run on.
//!
//! A decode step is a few hundred short parallel regions (one per mat-vec, the GDN heads, the
//! attention heads) with serial element-wise work between them. Rayon parks its idle workers, so
//! on a many-core machine every region first pays their wake-up, which there costs more than the
//! region's own work (the device machine's 16-core VM, 2026-12-05: the `small` model decoded
//! slower on 16 threads than this 2-core machine did on 2). A [`SpinPool`] keeps its workers
//! spinning on an atomic between regions (parking only after [`SpinPool::new`]'s `spin` of
//! idleness), so a region starts in about one cache-line transfer.
//!
//! The loops here ([`for_each_index`], [`for_each_chunk_mut`], [`for_each_chunk_mut2`],
//! [`for_each_chunk_mut3`]) run on the pool installed on the calling thread
//! ([`SpinPool::install`]), else on rayon's current pool. Inside a task (a nested loop) they run
//! serially on the task's thread. Each index runs exactly once whatever runs it, and the ops give
//! every index its own arithmetic, so results do not depend on the pool or the thread count.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// What the calling thread's parallel loops run on.
#[derive(Clone, Copy)]
enum Ctx {
    /// rayon's current pool
    Rayon,
    /// the installed pool (valid while [`SpinPool::install`]'s closure runs)
    Pool(*const SpinPool),
    /// inside a task: nested loops run serially
    Serial,
}

thread_local! {
    static CTX: Cell<Ctx> = const { Cell::new(Ctx::Rayon) };
}

/// Restores the thread's previous context on drop (also when the closure panics).
struct CtxGuard(Ctx);

impl Drop for CtxGuard {
    fn drop(&mut self) {
        CTX.with(|c| c.set(self.0));
    }
}

fn enter(ctx: Ctx) -> CtxGuard {
    CtxGuard(CTX.with(|c| c.replace(ctx)))
}

/// The type-erased call of a loop body: `(*(data as *const F))(i)`.
type Call = unsafe fn(*const (), usize);

/// `(*(data as *const F))(i)`.
///
/// # Safety
/// `data` must point to a live `F`.
unsafe fn call_body<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    // SAFETY: the caller passes the `&F` that `SpinPool::run` erased, alive until `run` returns.
    let f = unsafe { &*(data as *const F) };
    f(i)
}

/// A value on a cache line of its own (the spinning readers of one counter must not slow down
/// the writers of another).
#[repr(align(128))]
struct Line<T>(T);

impl<T> std::ops::Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// One published loop: `call(data, i)` for i in `0..n`, claimed `grain` indices at a time. Atomic
/// fields, so that a worker reading a slot while the owner rewrites it (for a job 4 epochs later)
/// reads stale values, never a data race; it then fails its claim and uses none of them.
struct Slot {
    data: AtomicPtr<()>,
    call: AtomicUsize,
    n: AtomicUsize,
    grain: AtomicUsize,
}

const SLOTS: usize = 4;

/// `state`'s fields: the job's epoch (high 32 bits) and its next unclaimed index (low 32 bits).
fn epoch_of(state: u64) -> u32 {
    (state >> 32) as u32
}

struct Shared {
    /// epoch ‖ next index: the owner stores a new epoch (index 0) to publish a job; claims are
    /// compare-and-swaps that keep the epoch, so a claim on an old job cannot succeed
    state: Line<AtomicU64>,
    /// indices of the current job finished so far; the owner waits for all of them
    done: Line<AtomicUsize>,
    /// the job of epoch e is in `slots[e % SLOTS]`
    slots: [Slot; SLOTS],
    /// the first panic of a task of the current job
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    panicked: AtomicBool,
    /// workers parked (or about to park) on `cv`
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
    shutdown: AtomicBool,
    /// how long an idle worker spins before it parks
    spin: Duration,
}

impl Shared {
    /// Claim and run indices of the job of epoch `e` until none are left (or a newer job is
    /// published); a panic is kept for the owner. Every index is counted in `done` once run.
    fn work(&self, e: u32) {
        let slot = &self.slots[e as usize % SLOTS];
        let data = slot.data.load(Ordering::Relaxed) as *const ();
        let call = slot.call.load(Ordering::Relaxed);
        let n = slot.n.load(Ordering::Relaxed);
        let grain = slot.grain.load(Ordering::Relaxed).max(1);
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            let i0 = (cur & 0xffff_ffff) as usize;
            if epoch_of(cur) != e || i0 >= n {
                return;
            }
            let i1 = (i0 + grain).min(n);
            match self.state.compare_exchange_weak(
                cur,
                cur + (i1 - i0) as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Err(now) => {
                    cur = now;
                    continue;
                }
                Ok(_) => cur += (i1 - i0) as u64,
            }
            // the claim succeeded with the epoch unchanged since this thread read the slot: the
            // slot is job e's (the owner rewrites it only for epoch e + SLOTS, after publishing
            // e + 1, which would have failed the claim), and job e cannot end before these
            // indices are counted in `done`, so its body is alive
            // SAFETY: `call` holds a `Call` stored by `SpinPool::run` (a fn pointer as usize).
            let f: Call = unsafe { std::mem::transmute::<usize, Call>(call) };
            let r = catch_unwind(AssertUnwindSafe(|| {
                for i in i0..i1 {
                    // SAFETY: `data` is job e's live `&F` (above).
                    unsafe { f(data, i) }
                }
            }));
            if let Err(p) = r {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                if slot.is_none() {
                    *slot = Some(p);
                }
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(i1 - i0, Ordering::Release);
        }
    }
}

/// A fixed set of worker threads that spin between jobs; the thread that calls a loop works too.
/// See the module docs.
pub struct SpinPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// the owner's `run` in progress (a pool runs one job at a time)
    busy: AtomicBool,
}

impl SpinPool {
    /// A pool of `threads` threads in all: `threads − 1` workers plus the caller of each loop.
    /// An idle worker spins for `spin`, then parks until the next job.
    pub fn new(threads: usize, spin: Duration) -> std::io::Result<SpinPool> {
        let slot = || Slot {
            data: AtomicPtr::new(std::ptr::null_mut()),
            call: AtomicUsize::new(0),
            n: AtomicUsize::new(0),
            grain: AtomicUsize::new(1),
        };
        let shared = Arc::new(Shared {
            state: Line(AtomicU64::new(0)),
            done: Line(AtomicUsize::new(0)),
            slots: [slot(), slot(), slot(), slot()],
            panic: Mutex::new(None),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            spin,
        });
        let mut workers = Vec::new();
        for w in 1..threads.max(1) {
            let sh = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("bonsai-spin-{w}"))
                .spawn(move || worker(&sh));
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    // stop the ones already started
                    drop(SpinPool {
                        shared,
                        workers,
                        busy: AtomicBool::new(false),
                    });
                    return Err(e);
                }
            }
        }
        Ok(SpinPool {
            shared,
            workers,
            busy: AtomicBool::new(false),
        })
    }

    /// Threads in all (the workers and the caller).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Run `f` with this pool as the calling thread's loop pool (restored afterwards).
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        let _g = enter(Ctx::Pool(self));
        f()
    }

    /// `f(i)` for every i in `0..n` on this pool's threads and the caller's, `grain` indices per
    /// claim (0: about 8 claims per thread); returns when all have run. Workers that are not
    /// spinning when the job starts are not waited for: the indices go to whoever claims them.
    /// A panic in `f` is resumed here after the other indices have run.
    pub fn run<F: Fn(usize) + Sync>(&self, n: usize, grain: usize, f: &F) {
        if n == 0 {
            return;
        }
        if self.workers.is_empty()
            || n == 1
            || n > u32::MAX as usize
            || self.busy.swap(true, Ordering::Acquire)
        {
            // nothing to share, or another thread's job is running: this thread does it all
            let _g = enter(Ctx::Serial);
            (0..n).for_each(f);
            return;
        }
        let sh = &*self.shared;
        // grain 0: about 8 claims per thread (few enough to keep the shared counter cold)
        let grain = if grain == 0 {
            n / (8 * self.threads())
        } else {
            grain
        };
        let e = epoch_of(sh.state.load(Ordering::Relaxed)).wrapping_add(1);
        let slot = &sh.slots[e as usize % SLOTS];
        slot.data.store(f as *const F as *mut (), Ordering::Relaxed);
        slot.call
            .store(call_body::<F> as Call as usize, Ordering::Relaxed);
        slot.n.store(n, Ordering::Relaxed);
        slot.grain.store(grain.max(1), Ordering::Relaxed);
        sh.done.store(0, Ordering::Relaxed);
        // publish (SeqCst: paired with the parkers' check below)
        sh.state.store((e as u64) << 32, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            // a parker re-checks the state under the lock, so this notify cannot be missed
            let _l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.cv.notify_all();
        }
        {
            let _g = enter(Ctx::Serial);
            sh.work(e);
        }
        let mut k = 0u32;
        while sh.done.load(Ordering::Acquire) != n {
            k = k.wrapping_add(1);
            if k % 256 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        self.busy.store(false, Ordering::Release);
        if sh.panicked.swap(false, Ordering::Relaxed) {
            let p = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
            resume_unwind(p.unwrap_or_else(|| Box::new("a parallel task panicked")));
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.cv.notify_all();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(sh: &Shared) {
    let _g = enter(Ctx::Serial);
    // the epoch the pool started at, not a fresh load: a job published before this thread got
    // here is still one it may help with
    let mut seen = 0u32;
    loop {
        // wait for the next job: spin, then park
        let t0 = Instant::now();
        let mut k = 0u32;
        loop {
            let e = epoch_of(sh.state.load(Ordering::Acquire));
            if e != seen {
                seen = e;
                break;
            }
            if sh.shutdown.load(Ordering::Relaxed) {
                return;
            }
            k = k.wrapping_add(1);
            if k % 1024 != 0 {
                std::hint::spin_loop();
                continue;
            }
            if t0.elapsed() < sh.spin {
                continue;
            }
            let mut l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.sleepers.fetch_add(1, Ordering::SeqCst);
            while epoch_of(sh.state.load(Ordering::SeqCst)) == seen
                && !sh.shutdown.load(Ordering::SeqCst)
            {
                l = sh.cv.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            sh.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        sh.work(seen);
    }
}

/// Whether [`for_each_index`] counts its loops and their wall time (`BONSAI_CPU_PAR_STATS=1`).
fn stats_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("BONSAI_CPU_PAR_STATS").is_ok_and(|v| v == "1"))
}

static STAT_LOOPS: AtomicU64 = AtomicU64::new(0);
static STAT_NANOS: AtomicU64 = AtomicU64::new(0);

/// The parallel loops run (outside tasks) and their wall time since the last call, when
/// `BONSAI_CPU_PAR_STATS=1` (else `None`): the rest of a step's time is its serial work.
pub fn take_stats() -> Option<(u64, Duration)> {
    stats_on().then(|| {
        let loops = STAT_LOOPS.swap(0, Ordering::Relaxed);
        (
            loops,
            Duration::from_nanos(STAT_NANOS.swap(0, Ordering::Relaxed)),
        )
    })
}

/// `f(i)` for every i in `0..n`, in parallel on the calling thread's pool (see the module docs);
/// `grain`: indices per claim on a [`SpinPool`], 0 for about 8 claims per thread (rayon splits
/// adaptively).
pub fn for_each_index<F: Fn(usize) + Sync + Send>(n: usize, grain: usize, f: F) {
    let ctx = CTX.with(|c| c.get());
    let t0 = (stats_on() && !matches!(ctx, Ctx::Serial)).then(Instant::now);
    match ctx {
        // SAFETY: a `Pool` context is set only inside `SpinPool::install`, whose `&self` outlives it.
        Ctx::Pool(p) => unsafe { &*p }.run(n, grain, &f),
        Ctx::Serial => (0..n).for_each(f),
        Ctx::Rayon => (0..n).into_par_iter().for_each(f),
    }
    if let Some(t0) = t0 {
        STAT_LOOPS.fetch_add(1, Ordering::Relaxed);
        STAT_NANOS.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// A slice's base pointer shared by tasks that each take a distinct chunk of it.
struct Parts<T>(*mut T, usize);
// SAFETY: tasks take disjoint chunks (each chunk index runs once) of one live `&mut [T]`.
unsafe impl<T: Send> Sync for Parts<T> {}

impl<T> Parts<T> {
    fn new(s: &mut [T]) -> Self {
        Parts(s.as_mut_ptr(), s.len())
    }

    /// Chunk `i` of `chunk` elements (the last one may be shorter).
    ///
    /// # Safety
    /// No two live results may have the same `i`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn chunk(&self, i: usize, chunk: usize) -> &mut [T] {
        let a = (i * chunk).min(self.1);
        let b = (a + chunk).min(self.1);
        // SAFETY: `a..b` lies in the slice; chunk `i` is handed to one task only (the caller).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(a), b - a) }
    }
}

/// `f(i, chunk_i)` for the `chunk`-element chunks of `data` (the last may be shorter), in
/// parallel as [`for_each_index`].
pub fn for_each_chunk_mut<T: Send, F>(data: &mut [T], chunk: usize, grain: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    assert!(chunk > 0, "for_each_chunk_mut: chunk size 0");
    let n = data.len().div_ceil(chunk);
    let p = Parts::new(data);
    // SAFETY: each index i in 0..n runs once, so each chunk has one user.
    for_each_index(n, grain, |i| f(i, unsafe { p.chunk(i, chunk) }));
}

/// [`for_each_chunk_mut`] over two slices cut into the same number of chunks.
pub fn for_each_chunk_mut2<A: Send, B: Send, F>(
    a: &mut [A],
    ca: usize,
    b: &mut [B],
    cb: usize,
    grain: usize,
    f: F,
) where
    F: Fn(usize, &mut [A], &mut [B]) + Sync + Send,
{
    assert!(ca > 0 && cb > 0, "for_each_chunk_mut2: chunk size 0");
    let n = a.len().div_ceil(ca);
    assert_eq!(
        n,
        b.len().div_ceil(cb),
        "for_each_chunk_mut2: chunk counts differ"
    );
    let (pa, pb) = (Parts::new(a), Parts::new(b));
    // SAFETY: each index i in 0..n runs once, so each chunk has one user.
    for_each_index(n, grain, |i| {
        f(i, unsafe { pa.chunk(i, ca) }, unsafe { pb.chunk(i, cb) })
    });
}

/// [`for_each_chunk_mut`] over three slices cut into the same number of chunks.
#[allow(clippy::too_many_arguments)]
pub fn for_each_chunk_mut3<A: Send, B: Send, C: Send, F>(
    a: &mut [A],
    ca: usize,
    b: &mut [B],
    cb: usize,
    c: &mut [C],
    cc: usize,
    grain: usize,
    f: F,
) where
    F: Fn(usize, &mut [A], &mut [B], &mut [C]) + Sync + Send,
{
    assert!(
        ca > 0 && cb > 0 && cc > 0,
        "for_each_chunk_mut3: chunk size 0"
    );
    let n = a.len().div_ceil(ca);
    assert_eq!(
        n,
        b.len().div_ceil(cb),
        "for_each_chunk_mut3: chunk counts differ"
    );
    assert_eq!(
        n,
        c.len().div_ceil(cc),
        "for_each_chunk_mut3: chunk counts differ"
    );
    let (pa, pb, pc) = (Parts::new(a), Parts::new(b), Parts::new(c));
    // SAFETY: each index i in 0..n runs once, so each chunk has one user.
    for_each_index(n, grain, |i| {
        f(
            i,
            unsafe { pa.chunk(i, ca) },
            unsafe { pb.chunk(i, cb) },
            unsafe { pc.chunk(i, cc) },
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_once_on_every_pool() {
        let pool = SpinPool::new(4, Duration::from_micros(200)).unwrap();
        for n in [0usize, 1, 2, 7, 64, 1000] {
            for grain in [1usize, 3, 16] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                let count = |i: usize| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                };
                pool.install(|| for_each_index(n, grain, count));
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "pool n={n} grain={grain}"
                );
                for_each_index(n, grain, count);
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 2),
                    "rayon n={n}"
                );
            }
        }
    }

    #[test]
    fn a_job_published_before_the_workers_start_is_still_finished() {
        // (a worker that read the epoch only when it started would miss the first job: hang)
        for round in 0..50 {
            let pool = SpinPool::new(4, Duration::from_micros(50 * (round % 3))).unwrap();
            let hits = AtomicUsize::new(0);
            for _ in 0..20 {
                pool.run(64, 1, &|_| {
                    hits.fetch_add(1, Ordering::Relaxed);
                });
            }
            assert_eq!(hits.load(Ordering::Relaxed), 64 * 20);
        }
    }

    #[test]
    fn chunks_cover_the_slices_and_nested_loops_run_serially() {
        let pool = SpinPool::new(3, Duration::from_millis(1)).unwrap();
        let mut a = vec![0u32; 103];
        let mut b = vec![0u64; 11 * 2];
        pool.install(|| {
            for_each_chunk_mut2(&mut a, 10, &mut b, 2, 1, |i, ca, cb| {
                for (j, x) in ca.iter_mut().enumerate() {
                    *x = (i * 10 + j) as u32;
                }
                // a nested loop inside a task: serial on this thread
                let sum = AtomicUsize::new(0);
                for_each_index(5, 1, |k| {
                    sum.fetch_add(k, Ordering::Relaxed);
                });
                cb[0] = i as u64;
                cb[1] = sum.load(Ordering::Relaxed) as u64;
            })
        });
        assert!(a.iter().enumerate().all(|(i, &x)| x == i as u32));
        assert!(b.chunks(2).enumerate().all(|(i, c)| c == [i as u64, 10]));
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_goes_on() {
        let pool = SpinPool::new(4, Duration::from_micros(100)).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.install(|| {
                for_each_index(100, 1, |i| {
                    if i == 37 {
                        panic!("task 37");
                    }
                })
            })
        }));
        let msg = r.unwrap_err();
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 37"));
        // the pool still runs every index afterwards, also after its workers parked
        std::thread::sleep(Duration::from_millis(5));
        let hits = AtomicUsize::new(0);
        pool.install(|| {
            for_each_index(500, 7, |_| {
                hits.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(hits.load(Ordering::Relaxed), 500);
    }
}
