//! Opening the files of a checkpoint without ever blocking on one.
//!
//! A shard or index that is a FIFO, a device, a socket or a directory is
//! refused by name, never read: a FIFO opened for reading waits for a writer
//! that may never come. Files are opened with `O_NONBLOCK` (which returns at
//! once for a FIFO), then `fstat`ed, and anything but a regular file is
//! refused; symbolic links to regular files are followed (the Hugging Face
//! cache is made of them). The runtime does the same (`open_regular` in
//! runtime/src/checkpoint.cpp).

use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::Path;

/// Why a file could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// There is no such file.
    NotFound,
    /// Anything else, as a message (`cannot open: ...`, `not a regular file`).
    Other(String),
}

impl OpenError {
    /// The message, the missing file included.
    pub fn message(&self) -> String {
        match self {
            OpenError::NotFound => "cannot open: No such file or directory".into(),
            OpenError::Other(m) => m.clone(),
        }
    }
}

/// The operating system's text for `e`, as `strerror` gives it (what the
/// runtime prints), without Rust's ` (os error N)`.
pub fn os_message(e: &std::io::Error) -> String {
    let text = e.to_string();
    match e.raw_os_error() {
        Some(code) => text.strip_suffix(&format!(" (os error {code})")).unwrap_or(&text).to_string(),
        None => text,
    }
}

/// Opens `path` for reading if it is a regular file; returns it and its
/// length ([`crate::files::open_regular`], with the messages the runtime's
/// reader gives).
pub fn open_regular(path: &Path) -> Result<(File, u64), OpenError> {
    crate::files::open_regular(path).map_err(|e| match e {
        crate::files::OpenError::NotFound(_) => OpenError::NotFound,
        crate::files::OpenError::Io(e) => OpenError::Other(format!("cannot open: {}", os_message(&e))),
        crate::files::OpenError::Stat(e) => OpenError::Other(format!("cannot stat: {}", os_message(&e))),
        crate::files::OpenError::NotRegular(_) => OpenError::Other("not a regular file".into()),
    })
}

/// Reads exactly `buf.len()` bytes, or says how many the file had.
pub fn read_exact(file: &mut File, buf: &mut [u8]) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => return Err(format!("cannot read: the file ended after {got} of {} bytes", buf.len())),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("cannot read: {}", os_message(&e))),
        }
    }
    Ok(())
}
