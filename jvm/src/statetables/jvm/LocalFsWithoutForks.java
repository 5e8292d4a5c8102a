package statetables.jvm;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.ChecksumFs;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.FsConstants;
import org.apache.hadoop.fs.FsServerDefaults;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.local.LocalConfigKeys;

import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;

/**
 * The same for Hadoop's FileContext API (`fs.AbstractFileSystem.file.impl`), which Delta's log store and Spark's
 * streaming checkpoint rename their files through: Hadoop's LocalFs over {@link LocalFileSystemWithoutForks.Raw}.
 * Hadoop's own RawLocalFs cannot be given another raw file system (its constructors are package-private), so its
 * four answers are repeated here.
 */
public class LocalFsWithoutForks extends ChecksumFs {
    public LocalFsWithoutForks(URI uri, Configuration conf) throws IOException, URISyntaxException {
        super(new Raw(conf));
    }

    static final class Raw extends DelegateToFileSystem {
        Raw(Configuration conf) throws IOException, URISyntaxException {
            super(FsConstants.LOCAL_FS_URI, new LocalFileSystemWithoutForks.Raw(), conf,
                    FsConstants.LOCAL_FS_URI.getScheme(), false);
        }

        @Override
        public int getUriDefaultPort() {
            return -1;
        }

        @Override
        public FsServerDefaults getServerDefaults(Path path) throws IOException {
            return LocalConfigKeys.getServerDefaults();
        }

        @Override
        @Deprecated
        public FsServerDefaults getServerDefaults() throws IOException {
            return LocalConfigKeys.getServerDefaults();
        }

        @Override
        public boolean isValidName(String src) {
            return true;  // local paths: any name the operating system accepts
        }
    }
}
