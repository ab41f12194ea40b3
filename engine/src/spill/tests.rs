use super::*;

/// A fresh directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir =
            std::env::temp_dir().join(format!("tandem-spill-test-{:016x}", rand::random::<u64>()));
        fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn layout() -> KvLayout {
    KvLayout {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        dtype: KvDtype::F16,
        header_only: false,
    }
}

fn open(dir: &Path, max_bytes: u64) -> Spill {
    let config = SpillConfig {
        dir: dir.into(),
        max_bytes,
    };
    Spill::open(&config, &[7; 32], layout(), Arc::default()).expect("open")
}

#[test]
fn a_block_comes_back_as_it_went_and_a_damaged_one_never() {
    let dir = TempDir::new();
    let spill = open(dir.path(), 1 << 20);
    let bytes = layout().block_bytes();
    let a: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    spill.store(1, &a);
    spill.store(2, &a);
    // Dropping the tier waits for its writer.
    drop(spill);
    let spill = open(dir.path(), 1 << 20);
    assert!(
        spill.contains(1) && spill.contains(2),
        "kept across a restart"
    );
    let mut out = vec![0; bytes];
    assert!(spill.load(1, &mut out));
    assert_eq!(out, a);

    let path = spill.shared.path(2);
    let mut file = fs::read(&path).expect("read");
    let mid = file.len() / 2;
    file[mid] ^= 1;
    fs::write(&path, file).expect("write");
    assert!(!spill.load(2, &mut out), "a flipped bit is caught");
    assert!(!spill.contains(2) && !path.exists(), "and the file is gone");
    assert_eq!(spill.shared.stats.corrupt.load(Ordering::Relaxed), 1);
    assert_eq!(
        spill.take_gone(),
        vec![2],
        "which the cache events announce"
    );
}

#[test]
fn the_tier_keeps_to_its_bound_least_recent_first_and_to_its_model() {
    let dir = TempDir::new();
    let file = (MAGIC.len() + 32 + 12 + 3 + 8 + layout().block_bytes() + 4) as u64;
    let spill = open(dir.path(), 2 * file);
    let block = vec![3; layout().block_bytes()];
    spill.store(1, &block);
    spill.store(2, &block);
    drop(spill);
    let spill = open(dir.path(), 2 * file);
    let mut on_disk = spill.hashes();
    on_disk.sort_unstable();
    assert_eq!(on_disk, vec![1, 2], "what a restarted node announces");
    assert!(spill.contains(1), "1 is now the most recent");
    spill.store(3, &block);
    let shared = spill.shared.clone();
    drop(spill);
    assert_eq!(*shared.gone(), vec![2], "the least recently used went");
    let spill = open(dir.path(), 2 * file);
    assert!(spill.contains(1) && spill.contains(3));
    assert!(!spill.contains(2));
    drop(spill);

    let slot = dir.path().join("slot-0");
    let unrelated = slot.join("notes");
    fs::create_dir_all(&unrelated).expect("unrelated dir");
    let other = SpillConfig {
        dir: dir.path().into(),
        max_bytes: 1 << 20,
    };
    let spill = Spill::open(&other, &[8; 32], layout(), Arc::default()).expect("open");
    assert!(
        !spill.contains(1),
        "another model's blocks are not this one's"
    );
    let dirs = fs::read_dir(&slot)
        .expect("read dir")
        .flatten()
        .filter(|e| e.path().is_dir())
        .count();
    assert_eq!(dirs, 2, "its directory is removed, and only that");
    assert!(unrelated.exists(), "a directory that is not a tier's stays");
}

#[test]
fn nodes_that_share_a_directory_take_slots_of_their_own() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    let first = open(dir.path(), 1 << 20);
    first.store(1, &vec![1; layout().block_bytes()]);
    let second = open(dir.path(), 1 << 20);
    assert!(
        !second.contains(1),
        "the second node is in a slot of its own"
    );
    let file = first.shared.path(1);
    drop(first);
    let mode = |p: &Path| fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
    assert_eq!(mode(&file), 0o600, "a block is the owner's only");
    assert_eq!(mode(file.parent().expect("tier dir")), 0o700);
    assert_eq!(mode(&dir.path().join("slot-0")), 0o700);
    let again = open(dir.path(), 1 << 20);
    assert!(
        again.contains(1),
        "a restarted node takes the free slot, and its blocks"
    );
}

#[test]
fn foreign_and_torn_files_are_skipped_and_counted() {
    let dir = TempDir::new();
    let other = SpillConfig {
        dir: dir.path().join("other"),
        max_bytes: 1 << 20,
    };
    let foreign = Spill::open(&other, &[8; 32], layout(), Arc::default()).expect("open");
    foreign.store(5, &vec![5; layout().block_bytes()]);
    let foreign_file = foreign.shared.path(5);
    drop(foreign);
    let spill = open(dir.path(), 1 << 20);
    let tier = spill.shared.dir.clone();
    drop(spill);
    // Another model's block under this model's name, and a torn block.
    fs::copy(&foreign_file, tier.join(format!("{:016x}.kv", 5))).expect("copy");
    fs::write(tier.join(format!("{:016x}.kv", 6)), b"torn").expect("write");
    let stats = Arc::new(SpillStats::default());
    let config = SpillConfig {
        dir: dir.path().into(),
        max_bytes: 1 << 20,
    };
    let spill = Spill::open(&config, &[7; 32], layout(), stats.clone()).expect("open");
    assert!(!spill.contains(6), "a torn file is not indexed");
    let mut out = vec![0; layout().block_bytes()];
    assert!(spill.contains(5));
    assert!(
        !spill.load(5, &mut out),
        "another model's block is never served"
    );
    assert_eq!(stats.corrupt.load(Ordering::Relaxed), 2, "both are counted");
}
