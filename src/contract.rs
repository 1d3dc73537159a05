//! The contract between the planner and the device library: every constant
//! both sides use (the page ring, scratch and staging sizes, warp roles,
//! per-operation limits), defined once in `device/mkc/contract.h` and read
//! from there at build time (`build.rs`), so no number is mirrored by hand.
//! The planner and the emitter check operations against these and refuse
//! what the device cannot run, by the operation's name.

include!(concat!(env!("OUT_DIR"), "/contract.rs"));
