//! Where a CPU step's time goes, for finding what keeps many threads from
//! scaling: with `MOEFLUX_CPU_PROFILE=1` every parallel region started on
//! the pool is timed, per place in the source that started it: its wall
//! time, the time its tasks ran summed over the threads (so wall ×
//! threads − busy is what waiting for the region's last task and handing
//! out work cost), and the serial time since the previous region ended
//! (routing's choice, the expert cache, sampling: whatever runs on one
//! thread outside the regions). `moeflux bench` prints the totals.
//! Off by default: the clocks cost a little on every task.

use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Whether regions are timed (`MOEFLUX_CPU_PROFILE`), read once.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(crate::tuning::cpu_profile)
}

#[derive(Default)]
struct Site {
    regions: u64,
    tasks: u64,
    threads: u64,
    wall_ns: u64,
    /// Σ wall × threads over the regions.
    capacity_ns: u64,
    busy_ns: u64,
    serial_before_ns: u64,
}

struct Totals {
    sites: HashMap<&'static Location<'static>, Site>,
    first: Instant,
    /// When the last region ended, whichever thread ran it: a step's
    /// forward pass may move between the pool's threads from one call to
    /// the next.
    last_end: Instant,
}

fn totals() -> &'static Mutex<Option<Totals>> {
    static TOTALS: Mutex<Option<Totals>> = Mutex::new(None);
    &TOTALS
}

/// One region being timed: started by [`Probe::start`], its tasks timed by
/// [`Probe::task`], recorded by [`Probe::finish`].
pub struct Probe {
    site: &'static Location<'static>,
    start: Instant,
    busy_ns: AtomicU64,
}

impl Probe {
    pub fn start(site: &'static Location<'static>) -> Probe {
        Probe {
            site,
            start: Instant::now(),
            busy_ns: AtomicU64::new(0),
        }
    }

    /// Runs one task, adding its time to the region's.
    pub fn task(&self, body: impl FnOnce()) {
        let start = Instant::now();
        body();
        self.busy_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }

    /// Records the region, run as `tasks` tasks on up to `threads` threads.
    pub fn finish(self, tasks: usize, threads: usize) {
        let end = Instant::now();
        let mut totals = totals().lock().unwrap_or_else(|e| e.into_inner());
        let totals = totals.get_or_insert_with(|| Totals {
            sites: HashMap::new(),
            first: self.start,
            last_end: self.start,
        });
        let serial = self.start.saturating_duration_since(totals.last_end);
        totals.last_end = totals.last_end.max(end);
        let site = totals.sites.entry(self.site).or_default();
        site.regions += 1;
        site.tasks += tasks as u64;
        site.threads += threads as u64;
        let wall = (end - self.start).as_nanos() as u64;
        site.wall_ns += wall;
        site.capacity_ns += wall * threads as u64;
        site.busy_ns += self.busy_ns.into_inner();
        site.serial_before_ns += serial.as_nanos() as u64;
    }
}

/// The timed regions so far, most wall time first, and forgets them; `None`
/// when profiling is off or no region ran.
pub fn report() -> Option<String> {
    let Totals { sites, first, .. } = totals().lock().unwrap_or_else(|e| e.into_inner()).take()?;
    let elapsed = first.elapsed().as_secs_f64() * 1e3;
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut rows: Vec<_> = sites.into_iter().collect();
    rows.sort_by_key(|(_, s)| std::cmp::Reverse(s.wall_ns + s.serial_before_ns));
    let wall: u64 = rows.iter().map(|(_, s)| s.wall_ns).sum();
    let serial: u64 = rows.iter().map(|(_, s)| s.serial_before_ns).sum();
    let mut out = format!(
        "CPU profile: {elapsed:.1} ms since the first region; {:.1} ms in regions, {:.1} ms on the calling thread between them\n\
         {:<34} {:>8} {:>10} {:>9} {:>7} {:>8} {:>9} {:>12}\n",
        ms(wall),
        ms(serial),
        "region (started at)",
        "regions",
        "wall ms",
        "µs each",
        "tasks",
        "threads",
        "busy",
        "serial before",
    );
    for (site, s) in rows {
        let file = site.file();
        let file = file.rsplit_once("/src/").map_or(file, |(_, f)| f);
        let n = s.regions.max(1) as f64;
        let busy = s.busy_ns as f64 / s.capacity_ns.max(1) as f64;
        out.push_str(&format!(
            "{:<34} {:>8} {:>10.2} {:>9.1} {:>7.1} {:>8.1} {:>8.0}% {:>9.2} ms\n",
            format!("{file}:{}", site.line()),
            s.regions,
            ms(s.wall_ns),
            s.wall_ns as f64 / n / 1e3,
            s.tasks as f64 / n,
            s.threads as f64 / n,
            100.0 * busy,
            ms(s.serial_before_ns),
        ));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_is_reported_under_its_site_with_its_tasks_and_serial_time() {
        let site = Location::caller();
        let first = Probe::start(site);
        first.task(|| std::thread::sleep(std::time::Duration::from_millis(2)));
        first.finish(1, 1);
        std::thread::sleep(std::time::Duration::from_millis(3));
        let second = Probe::start(site);
        for _ in 0..4 {
            second.task(|| std::thread::sleep(std::time::Duration::from_millis(1)));
        }
        second.finish(4, 2);
        let text = report().expect("two regions recorded");
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("backend/cpu/profile.rs:{}", site.line())))
            .unwrap_or_else(|| panic!("no row for the site in\n{text}"));
        let cells: Vec<&str> = row.split_whitespace().collect();
        // regions, wall ms, µs each, tasks a region, threads a region, busy, serial ms
        assert_eq!(cells[1], "2", "{row}");
        assert!(cells[2].parse::<f64>().unwrap() >= 6.0, "{row}");
        assert_eq!(cells[4], "2.5", "{row}");
        assert_eq!(cells[5], "1.5", "{row}");
        assert!(cells[7].parse::<f64>().unwrap() >= 3.0, "{row}");
        assert!(report().is_none(), "a report forgets what it reported");
    }
}
