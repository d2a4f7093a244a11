//! The CPU backend's threads for its parallel loops.
//!
//! A decode step runs a few parallel regions per layer (attention's
//! products, the experts' gate/up and down), each tens of microseconds on
//! many cores. Rayon's idle workers sleep after a few rounds of yielding,
//! and waking a sleeping thread costs microseconds on bare metal and more
//! in a virtual machine, so with rayon every region paid wake-ups. Here
//! the caller and the pool's workers claim a region's tasks from one
//! atomic counter (so tasks of any size balance as they finish), and the
//! workers spin for a while after each region before they park
//! ([`crate::tuning::cpu_spin`]), so the next region of the same step
//! finds them awake.
//!
//! A region takes as many threads as rayon's current pool has (the CLI's
//! `--threads`; one inside a one-thread pool). One region runs at a time:
//! a caller that finds the pool busy (another thread's region, e.g. the
//! server's or a test's), or a task that starts a region of its own, runs
//! it on its own thread. Each task computes the same thing whichever
//! thread takes it, so results do not depend on the pool.

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::profile;

/// Runs `body(i)` for every `i` in `0..tasks`, spread over the calling
/// thread and the pool's workers (`on_pool`) or rayon's; returns when all
/// are done. A panic in any task is resumed here once every task has
/// finished. With `MOEFLUX_CPU_PROFILE` a region that is not nested in
/// another is timed under the place in the source that started it.
#[track_caller]
pub fn run(on_pool: bool, tasks: usize, body: impl Fn(usize) + Sync) {
    if !profile::enabled() || IN_REGION.get() {
        run_region(on_pool, tasks, body);
        return;
    }
    let probe = profile::Probe::start(std::panic::Location::caller());
    let threads = run_region(on_pool, tasks, |i| probe.task(|| body(i)));
    probe.finish(tasks, threads);
}

/// [`run`]; returns the most threads that may have taken its tasks.
fn run_region(on_pool: bool, tasks: usize, body: impl Fn(usize) + Sync) -> usize {
    let threads = rayon::current_num_threads()
        .saturating_sub(LEFT_FREE.get())
        .max(1)
        .min(tasks);
    if threads <= 1 || IN_REGION.get() {
        inline(tasks, body);
        return 1;
    }
    if !on_pool {
        (0..tasks).into_par_iter().for_each(&body);
        return threads;
    }
    let pool = Pool::get();
    let mut workers = match pool.dispatch.try_lock() {
        Ok(workers) => workers,
        // A panic is only ever resumed after the guard is dropped, but a
        // poisoned lock would leave the workers idle for good.
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
        Err(TryLockError::WouldBlock) => {
            inline(tasks, body);
            return 1;
        }
    };
    let helpers = pool.grow(&mut workers, threads - 1);
    if helpers == 0 {
        drop(workers);
        inline(tasks, body);
        return 1;
    }
    let body: &(dyn Fn(usize) + Sync) = &body;
    // SAFETY: the job, and the body it points to, outlive every worker's
    // use of them: `Job::run` returns only once no worker holds the job.
    let job = Job {
        body: unsafe {
            std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(body)
        },
        tasks,
        helpers,
        next: AtomicUsize::new(0),
        panic: Mutex::new(None),
    };
    job.run(&pool.shared, &workers[..helpers]);
    drop(workers);
    if let Some(panic) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(panic);
    }
    helpers + 1
}

/// How many of an elementwise operation's `group`-long groups (heads,
/// rows) one task takes: enough work to pay for handing it to another
/// thread, so a decode step's few heads stay on the calling thread.
pub fn groups_per_task(group: usize) -> usize {
    const MIN_TASK_ELEMENTS: usize = 1 << 14;
    MIN_TASK_ELEMENTS.div_ceil(group.max(1))
}

/// [`run`] on the calling thread alone.
fn inline(tasks: usize, body: impl Fn(usize)) {
    let mut panic = None;
    for i in 0..tasks {
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| body(i))) {
            panic = Some(p);
        }
    }
    if let Some(p) = panic {
        resume_unwind(p);
    }
}

/// Runs `body(i, chunk)` for each `chunk`-long piece of `data` (the last
/// one shorter), as [`run`] does.
#[track_caller]
pub fn for_chunks_mut<T: Send>(
    on_pool: bool,
    data: &mut [T],
    chunk: usize,
    body: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    let (len, base) = (data.len(), SendPtr(data.as_mut_ptr()));
    run(on_pool, len.div_ceil(chunk), |i| {
        let start = i * chunk;
        let end = len.min(start + chunk);
        // SAFETY: each task index is run once and the pieces are disjoint
        // parts of `data`, borrowed mutably for the whole region.
        let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        body(i, piece);
    });
}

/// A pointer tasks may share: [`for_chunks_mut`] hands each task its own
/// part of what it points to.
struct SendPtr<T>(*mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SendPtr<T> {}

// SAFETY: used only for disjoint parts, one task each (`for_chunks_mut`).
unsafe impl<T: Send> Sync for SendPtr<T> {}
unsafe impl<T: Send> Send for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// By value, so closures capture the whole (shareable) wrapper.
    fn get(self) -> *mut T {
        self.0
    }
}

thread_local! {
    /// Whether this thread is running a region's tasks (a pool worker
    /// always is): a region started from a task runs inline.
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
    /// Threads of the pool this thread's regions leave unused.
    static LEFT_FREE: Cell<usize> = const { Cell::new(0) };
}

/// Makes this thread's regions take `threads` fewer of the pool's threads
/// (at least one): for a thread whose regions run while another thread
/// stays busy, which then keeps its core (hybrid decode's CPU share,
/// computed while the decode thread queues the GPU's).
pub fn leave_free(threads: usize) {
    LEFT_FREE.set(threads);
}

struct Pool {
    shared: Arc<Shared>,
    /// Held by the caller whose region runs; the workers started so far.
    dispatch: Mutex<Vec<Worker>>,
}

/// What the workers watch.
struct Shared {
    /// Bumped once per region; a worker joins each region once.
    epoch: AtomicU64,
    /// The running region's job, null between regions.
    job: AtomicPtr<Job>,
    /// Workers between announcing themselves and letting go of the job:
    /// the caller waits for none before its job goes out of scope.
    holding: AtomicUsize,
}

struct Worker {
    thread: Thread,
    /// Set while the worker is parked (or about to park).
    parked: Arc<AtomicBool>,
}

/// One region.
struct Job {
    body: &'static (dyn Fn(usize) + Sync),
    tasks: usize,
    /// Workers that may join (the first this many of the pool).
    helpers: usize,
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Pool {
    fn get() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool {
            shared: Arc::new(Shared {
                epoch: AtomicU64::new(0),
                job: AtomicPtr::new(ptr::null_mut()),
                holding: AtomicUsize::new(0),
            }),
            dispatch: Mutex::new(Vec::new()),
        })
    }

    /// Starts workers until there are `count`, as far as the system lets
    /// it; returns how many of them a region may use.
    fn grow(&self, workers: &mut MutexGuard<'_, Vec<Worker>>, count: usize) -> usize {
        while workers.len() < count {
            let (shared, index) = (self.shared.clone(), workers.len());
            // Read before this region's epoch, so a worker that starts
            // late still joins it.
            let seen = shared.epoch.load(SeqCst);
            let parked = Arc::new(AtomicBool::new(false));
            let flag = parked.clone();
            let spawned = thread::Builder::new()
                .name(format!("moeflux-cpu-{index}"))
                .spawn(move || work(&shared, index, seen, &flag));
            let Ok(handle) = spawned else { break };
            workers.push(Worker {
                thread: handle.thread().clone(),
                parked,
            });
        }
        workers.len().min(count)
    }
}

impl Job {
    /// Publishes the job to `workers`, takes tasks on the calling thread,
    /// and returns once no worker holds the job any more.
    fn run(&self, shared: &Shared, workers: &[Worker]) {
        shared.job.store(ptr::from_ref(self).cast_mut(), SeqCst);
        shared.epoch.fetch_add(1, SeqCst);
        for w in workers {
            if w.parked.load(SeqCst) {
                w.thread.unpark();
            }
        }
        IN_REGION.set(true);
        self.take_tasks();
        IN_REGION.set(false);
        // No task is left to start: late workers must not find the job.
        shared.job.store(ptr::null_mut(), SeqCst);
        let mut rounds = 0u32;
        while shared.holding.load(SeqCst) != 0 {
            // A worker descheduled mid-task (more threads than cores)
            // needs this core.
            rounds = rounds.wrapping_add(1);
            if rounds.is_multiple_of(1024) {
                thread::yield_now();
            }
            std::hint::spin_loop();
        }
    }

    fn take_tasks(&self) {
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            if i >= self.tasks {
                return;
            }
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (self.body)(i))) {
                *self.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(panic);
            }
        }
    }
}

/// A worker's life: wait for a region past `seen`, join it if it admits
/// this worker, take tasks until none are left, and wait again.
fn work(shared: &Shared, index: usize, mut seen: u64, parked: &AtomicBool) {
    IN_REGION.set(true);
    let spin = crate::tuning::cpu_spin();
    loop {
        seen = wait_for_region(shared, seen, parked, spin);
        shared.holding.fetch_add(1, SeqCst);
        let job = shared.job.load(SeqCst);
        // SAFETY: a non-null job stays alive while `holding` counts this
        // worker (its caller waits for zero after clearing `job`).
        if let Some(job) = unsafe { job.as_ref() }
            && index < job.helpers
        {
            job.take_tasks();
        }
        shared.holding.fetch_sub(1, SeqCst);
    }
}

/// Spins until the epoch moves past `seen`, for at most `spin`, then
/// parks until it does; returns the new epoch.
fn wait_for_region(shared: &Shared, seen: u64, parked: &AtomicBool, spin: Duration) -> u64 {
    let moved = || Some(shared.epoch.load(Acquire)).filter(|&epoch| epoch != seen);
    if let Some(epoch) = spin_until(spin, 256, moved) {
        return epoch;
    }
    // Parked before the epoch is read again, and the caller reads `parked`
    // after bumping it: either this sees the bump or the caller unparks.
    parked.store(true, SeqCst);
    loop {
        let epoch = shared.epoch.load(SeqCst);
        if epoch != seen {
            parked.store(false, SeqCst);
            return epoch;
        }
        thread::park();
    }
}

/// Polls `ready` until it returns a value, for at most `spin`; `None`
/// when the time ran out. Every `yield_every` polls the core goes to any
/// thread waiting for it (a busy machine, or where threads outnumber
/// cores); otherwise the yield returns at once.
pub(crate) fn spin_until<T>(
    spin: Duration,
    yield_every: u32,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let start = Instant::now();
    let mut rounds = 0u32;
    loop {
        if let Some(value) = ready() {
            return Some(value);
        }
        rounds = rounds.wrapping_add(1);
        if rounds.is_multiple_of(yield_every) {
            if start.elapsed() >= spin {
                return None;
            }
            thread::yield_now();
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// `f` inside a rayon pool of `threads` threads (more than this
    /// machine may have cores, so regions split anyway).
    fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    #[test]
    fn a_spin_returns_the_value_or_gives_up_in_time() {
        let mut polls = 0;
        let found = spin_until(Duration::from_secs(10), 4, || {
            polls += 1;
            (polls == 10).then_some(polls)
        });
        assert_eq!(found, Some(10));
        let start = Instant::now();
        assert_eq!(spin_until(Duration::from_millis(5), 4, || None::<()>), None);
        assert!(start.elapsed() >= Duration::from_millis(5));
    }

    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 3, 8] {
            for on_pool in [true, false] {
                for tasks in [0, 1, 2, 3, 7, 8, 9, 100, 1000, 1023] {
                    let counts: Vec<AtomicUsize> =
                        (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                    with_threads(threads, || {
                        run(on_pool, tasks, |i| {
                            counts[i].fetch_add(1, Relaxed);
                        })
                    });
                    assert!(
                        counts.iter().all(|c| c.load(Relaxed) == 1),
                        "{tasks} tasks on {threads} threads (pool {on_pool})"
                    );
                }
            }
        }
    }

    #[test]
    fn a_region_uses_at_most_the_threads_asked_for() {
        for threads in [1, 2, 4] {
            let seen = Mutex::new(HashSet::new());
            with_threads(threads, || {
                for _ in 0..20 {
                    run(true, 64, |_| {
                        seen.lock().unwrap().insert(thread::current().id());
                        // Long enough for the workers to take some tasks.
                        thread::sleep(Duration::from_micros(50));
                    });
                }
            });
            let used = seen.into_inner().unwrap().len();
            assert!(used <= threads, "{used} threads used of {threads}");
            if threads == 1 {
                assert_eq!(used, 1);
            }
        }
    }

    #[test]
    fn a_thread_that_leaves_threads_free_uses_fewer() {
        for (threads, free, most) in [(4, 1, 3), (4, 3, 1), (2, 5, 1)] {
            let seen = Mutex::new(HashSet::new());
            with_threads(threads, || {
                leave_free(free);
                for _ in 0..20 {
                    run(true, 64, |_| {
                        seen.lock().unwrap().insert(thread::current().id());
                        thread::sleep(Duration::from_micros(50));
                    });
                }
                leave_free(0);
            });
            let used = seen.into_inner().unwrap().len();
            assert!(used <= most, "{used} threads used of {threads} less {free}");
        }
    }

    #[test]
    fn chunks_cover_the_slice_and_nested_regions_run_inline() {
        for on_pool in [true, false] {
            let mut data = vec![0usize; 1001];
            with_threads(4, || {
                for_chunks_mut(on_pool, &mut data, 10, |i, piece| {
                    let mut inner = vec![0usize; piece.len()];
                    for_chunks_mut(on_pool, &mut inner, 3, |_, p| {
                        p.iter_mut().for_each(|v| *v = 1)
                    });
                    for (v, one) in piece.iter_mut().zip(inner) {
                        *v = i + one;
                    }
                })
            });
            for (k, &v) in data.iter().enumerate() {
                assert_eq!(v, k / 10 + 1, "pool {on_pool}");
            }
        }
    }

    #[test]
    fn nested_regions_run_every_inner_task_once() {
        let counts: Vec<AtomicUsize> = (0..37 * 11).map(|_| AtomicUsize::new(0)).collect();
        with_threads(4, || {
            run(true, 37, |i| {
                run(true, 11, |j| {
                    counts[i * 11 + j].fetch_add(1, Relaxed);
                })
            })
        });
        assert!(counts.iter().all(|c| c.load(Relaxed) == 1));
    }

    #[test]
    fn a_panicking_task_panics_the_caller_after_the_others() {
        for on_pool in [true, false] {
            let done = AtomicUsize::new(0);
            let result = with_threads(4, || {
                catch_unwind(AssertUnwindSafe(|| {
                    run(on_pool, 64, |i| {
                        assert_ne!(i, 17, "task 17 fails");
                        done.fetch_add(1, Relaxed);
                    })
                }))
            });
            let message = result.expect_err("the panic reaches the caller");
            let text = message.downcast_ref::<String>().map(String::as_str);
            assert!(
                text.is_some_and(|t| t.contains("task 17 fails")),
                "{text:?}"
            );
            // Rayon drops the rest of a panicking task's split.
            if on_pool {
                assert_eq!(done.load(Relaxed), 63);
            }
        }
        // The pool's workers still take tasks (retried while other tests'
        // regions hold them).
        let on_worker = AtomicBool::new(false);
        with_threads(2, || {
            for _ in 0..1000 {
                run(true, 16, |_| {
                    if thread::current()
                        .name()
                        .is_some_and(|n| n.starts_with("moeflux-cpu"))
                    {
                        on_worker.store(true, Relaxed);
                    }
                    thread::sleep(Duration::from_micros(50));
                });
                if on_worker.load(Relaxed) {
                    break;
                }
            }
        });
        assert!(on_worker.load(Relaxed), "no task ran on a worker");
    }

    #[test]
    fn regions_from_many_threads_at_once() {
        thread::scope(|s| {
            for caller in 0..4 {
                s.spawn(move || {
                    with_threads(3, || {
                        for round in 0..200 {
                            let tasks = 1 + (caller * 7 + round) % 50;
                            let counts: Vec<AtomicUsize> =
                                (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                            run(true, tasks, |i| {
                                counts[i].fetch_add(1, Relaxed);
                            });
                            assert!(counts.iter().all(|c| c.load(Relaxed) == 1));
                        }
                    })
                });
            }
        });
    }
}
