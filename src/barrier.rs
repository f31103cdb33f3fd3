//! The solo barrier: a suspect runs with no other handler running in the process.
//!
//! When a process dies, every delivery it held comes back `redelivered`: the one
//! that killed it and its innocent neighbours alike. Counting those deliveries
//! would condemn the neighbours after a few crashes. So a redelivery is only a
//! suspect: it runs alone, and only a death while it ran alone is evidence
//! against it.
//!
//! The barrier is a fair reader-writer lock, one per process, shared by every
//! consumer the process runs and by its outbox relays: ordinary work (a
//! handler, a relay's batch) holds it shared while it runs; a suspect takes it
//! exclusively. Work already running finishes first; work that
//! arrives while a suspect waits queues behind it (the lock is fair, so a stream
//! of ordinary work cannot starve a suspect), and runs when the suspect settles.

use std::sync::{Arc, LazyLock};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

/// Shared by ordinary runs, taken alone by a suspect.
#[derive(Debug, Clone, Default)]
pub(crate) struct SoloBarrier {
    lock: Arc<RwLock<()>>,
}

/// Held while an ordinary run's handler runs.
#[derive(Debug)]
pub(crate) struct Shared(
    #[expect(dead_code, reason = "held for its drop")] OwnedRwLockReadGuard<()>,
);

/// Held while a suspect runs: nothing else in the process runs a handler.
#[derive(Debug)]
pub(crate) struct Alone(
    #[expect(dead_code, reason = "held for its drop")] OwnedRwLockWriteGuard<()>,
);

static PROCESS: LazyLock<SoloBarrier> = LazyLock::new(SoloBarrier::default);

impl SoloBarrier {
    /// The barrier of this process, which every consumer in it shares.
    pub(crate) fn process() -> Self {
        PROCESS.clone()
    }

    /// Waits until no suspect runs or waits ahead, then holds the barrier
    /// shared.
    pub(crate) async fn shared(&self) -> Shared {
        Shared(Arc::clone(&self.lock).read_owned().await)
    }

    /// Waits until the work already running has finished, then holds the barrier
    /// alone; work that arrives meanwhile waits behind.
    pub(crate) async fn alone(&self) -> Alone {
        Alone(Arc::clone(&self.lock).write_owned().await)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// Polls `f` until it holds, for at most a second.
    async fn eventually(f: impl Fn() -> bool) {
        for _ in 0..1000 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("condition never held");
    }

    #[tokio::test]
    async fn a_suspect_waits_for_running_work_and_new_work_waits_for_the_suspect() {
        let barrier = SoloBarrier::default();
        let running = barrier.shared().await;

        let suspect_ran = Arc::new(AtomicUsize::new(0));
        let suspect = tokio::spawn({
            let (barrier, ran) = (barrier.clone(), Arc::clone(&suspect_ran));
            async move {
                let alone = barrier.alone().await;
                ran.store(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(alone);
            }
        });
        // The suspect is queued behind the running work.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            suspect_ran.load(Ordering::SeqCst),
            0,
            "ran beside other work"
        );

        // New work arriving now queues behind the waiting suspect.
        let later_ran = Arc::new(AtomicUsize::new(0));
        let later = tokio::spawn({
            let (barrier, ran, suspect_ran) = (
                barrier.clone(),
                Arc::clone(&later_ran),
                Arc::clone(&suspect_ran),
            );
            async move {
                let _shared = barrier.shared().await;
                assert_eq!(
                    suspect_ran.load(Ordering::SeqCst),
                    1,
                    "overtook the suspect"
                );
                ran.store(1, Ordering::SeqCst);
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            later_ran.load(Ordering::SeqCst),
            0,
            "ran before the suspect"
        );

        drop(running);
        eventually(|| suspect_ran.load(Ordering::SeqCst) == 1).await;
        suspect.await.unwrap();
        later.await.unwrap();
        assert_eq!(later_ran.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn ordinary_work_runs_side_by_side() {
        let barrier = SoloBarrier::default();
        let a = barrier.shared().await;
        let b = tokio::time::timeout(Duration::from_secs(1), barrier.shared())
            .await
            .expect("two ordinary runs at once");
        drop((a, b));
        let _alone = barrier.alone().await;
    }

    #[test]
    fn every_consumer_in_the_process_shares_one_barrier() {
        assert!(Arc::ptr_eq(
            &SoloBarrier::process().lock,
            &SoloBarrier::process().lock
        ));
    }
}
