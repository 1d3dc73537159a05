//! The files mkc reads and writes, kept safe from hostile paths: outputs are
//! written to a temporary file in their folder and renamed into place, and a
//! symbolic link (or anything but a regular file) where an output goes is
//! refused by name, never followed.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::diag::{Error, ErrorKind, Result};

/// Refuses `path` as an output unless it is missing or a regular file: a
/// symbolic link there would make mkc write wherever it points.
pub fn check_output(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::new(ErrorKind::Io, format!("cannot write {}: {e}", path.display()))),
        Ok(m) if m.file_type().is_symlink() => Err(Error::new(
            ErrorKind::Io,
            format!("refusing to write {}: it is a symbolic link, which mkc does not follow", path.display()),
        )
        .help("remove the link, or choose another output folder")),
        Ok(m) if !m.is_file() => Err(Error::new(
            ErrorKind::Io,
            format!("refusing to write {}: it exists and is not a regular file", path.display()),
        )),
        Ok(_) => Ok(()),
    }
}

/// Writes `files` (name, contents) into `folder`, creating it if missing.
/// Every target is checked before anything is written; each file goes to a
/// fresh temporary file in `folder` (created exclusively, so never through a
/// link) and is renamed over the target. Returns the paths written, in order.
pub fn write_folder(folder: &Path, files: &[(String, Vec<u8>)]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(folder)
        .map_err(|e| Error::new(ErrorKind::Io, format!("cannot create {}: {e}", folder.display())))?;
    for (name, _) in files {
        check_output(&folder.join(name))?;
    }
    files.iter().map(|(name, bytes)| write_one(folder, name, bytes)).collect()
}

/// Writes one file at `path` as [`write_folder`] does: refused if a link or
/// anything but a regular file is there, written to a temporary file beside
/// it and renamed into place.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    check_output(path)?;
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::new(ErrorKind::Io, format!("cannot write {}: not a file name mkc can write", path.display()))
    })?;
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    write_one(folder, name, bytes).map(|_| ())
}

fn write_one(folder: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let path = folder.join(name);
    let tmp = folder.join(format!(".{name}.{}.tmp", std::process::id()));
    let fail = |e: std::io::Error| Error::new(ErrorKind::Io, format!("cannot write {}: {e}", path.display()));
    // A stale temporary file of an earlier run with this process id; removing
    // a link removes the link only.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(fail(e)),
        _ => {}
    }
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.flush()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    Ok(path)
}

/// Why [`open_regular`] refused a path.
#[derive(Debug)]
pub enum OpenError {
    /// There is no such file.
    NotFound(std::io::Error),
    /// It could not be opened.
    Io(std::io::Error),
    /// It was opened and could not be examined (`fstat`).
    Stat(std::io::Error),
    /// It is there, and not a regular file.
    NotRegular(std::fs::FileType),
}

/// Opens `path` for reading if it is a regular file (a symbolic link to one
/// is followed); returns it and its length. It is opened non-blocking, so a
/// FIFO with no writer does not hang the open, and examined with `fstat` on
/// the open file before a byte is read. Every input mkc reads, checkpoints
/// included, is opened here.
pub fn open_regular(path: &Path) -> std::result::Result<(std::fs::File, u64), OpenError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(OpenError::NotFound(e)),
        Err(e) => return Err(OpenError::Io(e)),
    };
    let meta = file.metadata().map_err(OpenError::Stat)?;
    if !meta.is_file() {
        return Err(OpenError::NotRegular(meta.file_type()));
    }
    Ok((file, meta.len()))
}

/// What a file that is not a regular one is, in messages ("a FIFO").
pub fn file_kind(ty: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ty.is_dir() {
        "a directory"
    } else if ty.is_fifo() {
        "a FIFO"
    } else if ty.is_char_device() {
        "a character device"
    } else if ty.is_block_device() {
        "a block device"
    } else if ty.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// The kinds of file mkc reads, each with the largest size it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// A graph file (`graph.mkc`): at most 16 MiB (the K3 graph is 10 KB).
    Graph,
    /// A model config (JSON or YAML): at most 64 MiB (configs are a few KB).
    Config,
    /// A target file: at most 1 MiB (targets are 2 KB).
    Target,
    /// A measured step's Chrome trace (`plan --trace`): at most 1 GiB (the
    /// full K3's is about 20 MB).
    Trace,
}

impl Input {
    /// The largest file of this kind mkc reads, in bytes.
    pub const fn limit(self) -> u64 {
        match self {
            Input::Graph => 16 << 20,
            Input::Config => 64 << 20,
            Input::Target => 1 << 20,
            Input::Trace => 1 << 30,
        }
    }

    /// What the file is, in error messages.
    pub const fn what(self) -> &'static str {
        match self {
            Input::Graph => "graph",
            Input::Config => "config",
            Input::Target => "target",
            Input::Trace => "trace",
        }
    }
}

/// Reads an input file of `kind` as UTF-8 text, refusing by name anything
/// that is not a regular file (a device such as `/dev/zero`, a FIFO, a
/// directory) and any file over the kind's [`Input::limit`]. The file is
/// opened non-blocking, so opening a FIFO with no writer does not hang, and
/// checked with `fstat` on the open file before a byte is read; the read
/// itself stops at the limit, so a file that grows meanwhile cannot fill
/// memory either.
pub fn read_input(path: &Path, kind: Input) -> Result<String> {
    use std::io::Read;
    let what = kind.what();
    let fail = |why: String| Error::new(ErrorKind::Io, format!("cannot read {what} {}: {why}", path.display()));
    let (file, len) = open_regular(path).map_err(|e| match e {
        OpenError::NotFound(e) | OpenError::Io(e) | OpenError::Stat(e) => fail(e.to_string()),
        OpenError::NotRegular(ty) => fail(format!("it is {}; mkc reads regular files only", file_kind(ty))),
    })?;
    let limit = kind.limit();
    let too_big =
        |size: u64| fail(format!("it is {size} bytes, more than the {} MiB a {what} file may be", limit >> 20));
    if len > limit {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|e| fail(e.to_string()))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    String::from_utf8(bytes)
        .map_err(|e| fail(format!("it is not UTF-8 text (byte {} is not valid UTF-8)", e.utf8_error().valid_up_to())))
}
