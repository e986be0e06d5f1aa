//! Device data shared between the workloads of one tuning run: random weights of one shape are
//! generated once and reused by every M bucket and candidate, helper kernels are loaded once.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use crate::RuntimeError;

struct Item {
    value: Arc<dyn Any + Send + Sync>,
    bytes: usize,
}

/// Values (device buffers, loaded helper kernels) by name, within a device-memory budget: when
/// a new value would exceed it, every other value is dropped first (workloads still holding one
/// keep it alive until they are done).
pub struct DevicePool {
    items: HashMap<String, Item>,
    bytes: usize,
    budget: usize,
}

impl DevicePool {
    /// An empty pool holding at most `budget` bytes.
    pub fn new(budget: usize) -> DevicePool {
        DevicePool {
            items: HashMap::new(),
            bytes: 0,
            budget,
        }
    }

    /// The value named `name`, made by `make` (which allocates `bytes` of device memory) if
    /// absent or of another type. Name values by everything they depend on (kind, shape, seed).
    pub fn get_or_try_insert<T: Any + Send + Sync>(
        &mut self,
        name: &str,
        bytes: usize,
        make: impl FnOnce() -> Result<T, RuntimeError>,
    ) -> Result<Arc<T>, RuntimeError> {
        if let Some(v) = self.items.get(name).and_then(|i| i.value.clone().downcast::<T>().ok()) {
            return Ok(v);
        }
        if let Some(old) = self.items.remove(name) {
            self.bytes -= old.bytes;
        }
        if self.bytes + bytes > self.budget {
            self.items.clear();
            self.bytes = 0;
        }
        let value = Arc::new(make()?);
        self.items.insert(
            name.to_string(),
            Item {
                value: value.clone(),
                bytes,
            },
        );
        self.bytes += bytes;
        Ok(value)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_made_once_by_name_and_type() {
        let mut pool = DevicePool::new(100);
        let mut made = 0;
        let mut get = |pool: &mut DevicePool, name: &str| {
            pool.get_or_try_insert(name, 10, || {
                made += 1;
                Ok(vec![1u8; 10])
            })
            .unwrap()
        };
        let a = get(&mut pool, "a");
        let again = get(&mut pool, "a");
        assert!(Arc::ptr_eq(&a, &again));
        get(&mut pool, "b");
        assert_eq!(made, 2);
        assert_eq!(pool.bytes(), 20);
        let other: Arc<u32> = pool.get_or_try_insert("a", 4, || Ok(7)).unwrap();
        assert_eq!((*other, pool.bytes()), (7, 14), "another type under a name replaces it");
    }

    #[test]
    fn over_budget_drops_the_rest_and_errors_keep_nothing() {
        let mut pool = DevicePool::new(100);
        let a = pool.get_or_try_insert("a", 60, || Ok(1u8)).unwrap();
        pool.get_or_try_insert("b", 60, || Ok(2u8)).unwrap();
        assert_eq!(pool.bytes(), 60, "a was dropped to make room");
        assert_eq!(*a, 1, "a holder keeps its value");
        let err = pool.get_or_try_insert::<u8>("c", 10, || Err(RuntimeError::NoDriver));
        assert!(err.is_err());
        assert_eq!(pool.bytes(), 60);
        let mut made = false;
        pool.get_or_try_insert("a", 60, || {
            made = true;
            Ok(1u8)
        })
        .unwrap();
        assert!(made, "a was made again");
    }
}
