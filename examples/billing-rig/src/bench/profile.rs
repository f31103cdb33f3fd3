//! `billing bench --profile DIR`: a flamegraph of this process (warren's
//! consumer, its relay, the benchmark's publishers) during rows 3, 3b, 4 and
//! 8 (its last round, a graph a format), with its stacks folded beside it,
//! sampled in process with pprof at 997 Hz, and the functions most samples
//! were taken in. Built only with the `profile` feature, so that the
//! profiler's dependencies stay out of every other build.

use std::future::Future;
use std::path::{Path, PathBuf};

/// A profile being taken, written to a file when [`finish`](Self::finish)ed.
pub(crate) struct Profile {
    #[cfg(feature = "profile")]
    guard: pprof::ProfilerGuard<'static>,
    path: PathBuf,
}

impl Profile {
    /// Starts sampling this process, for a flamegraph at `dir/name.svg`.
    pub(crate) fn start(dir: &Path, name: &str) -> Result<Self, String> {
        let path = dir.join(format!("{name}.svg"));
        #[cfg(feature = "profile")]
        {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(997)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .map_err(|e| format!("cannot start the profiler: {e}"))?;
            Ok(Self { guard, path })
        }
        #[cfg(not(feature = "profile"))]
        {
            let _ = path;
            Err(
                "--profile: this billing was built without the `profile` feature; build it \
                 with `cargo build --release -p billing --features profile`"
                    .into(),
            )
        }
    }

    /// Writes the flamegraph and returns the functions most samples were
    /// taken in (the innermost frame of each sample), with their share.
    pub(crate) fn finish(self) -> Result<(PathBuf, Vec<(String, f64)>), String> {
        #[cfg(feature = "profile")]
        {
            let report = self
                .guard
                .report()
                .build()
                .map_err(|e| format!("cannot build the profile: {e}"))?;
            let file = std::fs::File::create(&self.path)
                .map_err(|e| format!("cannot write {}: {e}", self.path.display()))?;
            report
                .flamegraph(file)
                .map_err(|e| format!("cannot write the flamegraph: {e}"))?;
            // Beside it, the stacks folded one a line (`outer;...;inner
            // count`, as flamegraph tools take them): two profiles compared
            // function by function, not only by their pictures.
            let folded_path = self.path.with_extension("folded");
            let mut folded = String::new();
            for (frames, count) in &report.data {
                let names: Vec<String> = frames
                    .frames
                    .iter()
                    .rev()
                    .flat_map(|inlined| inlined.iter().rev().map(|s| s.name()))
                    .collect();
                folded.push_str(&format!("{} {count}\n", names.join(";")));
            }
            std::fs::write(&folded_path, folded)
                .map_err(|e| format!("cannot write {}: {e}", folded_path.display()))?;
            let mut by_leaf: std::collections::HashMap<String, isize> = Default::default();
            let mut total = 0isize;
            for (frames, count) in &report.data {
                total += count;
                let leaf = frames
                    .frames
                    .first()
                    .and_then(|inlined| inlined.first())
                    .map_or_else(|| "(unknown)".to_owned(), |s| s.name());
                *by_leaf.entry(leaf).or_default() += count;
            }
            let mut top: Vec<(String, f64)> = by_leaf
                .into_iter()
                .map(|(name, n)| (name, n as f64 / total.max(1) as f64))
                .collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(15);
            Ok((self.path, top))
        }
        #[cfg(not(feature = "profile"))]
        {
            Ok((self.path, Vec::new()))
        }
    }
}

/// Runs `work` under a profile named `name` in `dir` when there is a `dir`,
/// and prints where the flamegraph went and the top functions.
pub(crate) async fn profiled<T>(
    dir: Option<&Path>,
    name: &str,
    work: impl Future<Output = T>,
) -> Result<T, String> {
    let Some(dir) = dir else {
        return Ok(work.await);
    };
    let profile = Profile::start(dir, name)?;
    let out = work.await;
    let (path, top) = profile.finish()?;
    println!("   flamegraph of this process: {}", path.display());
    for (function, share) in top {
        let shown: String = function.chars().take(110).collect();
        println!("     {:>5.1}%  {shown}", share * 100.0);
    }
    Ok(out)
}
