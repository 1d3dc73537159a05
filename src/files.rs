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
